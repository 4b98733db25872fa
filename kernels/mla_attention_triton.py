"""Triton absorbed-MLA attention over the paged latent cache, dense or top-k sparse, split-K.

One program per (query token, tile of BLOCK_H heads, context split): each latent row is read
once for all heads of the tile (up to 64 heads for small ranks, 16 at ``kv_lora_rank`` 512 to
bound registers; more heads re-read the rows from L2). Handles decode and packed varlen
queries (causal by position). Contract: :func:`kernels.mla_attention.mla_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import (check_launchable, choose_splits, combine_splits, interpreting, mma, pow2,
                                  split_buffers, token_metadata)

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_attention_kernel(
    qn_ptr, qp_ptr, cache_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr, topk_ptr, out_ptr, lse_ptr,
    qk_scale, keys_per_split, num_heads, num_topk,
    stride_qnt, stride_qnh, stride_qpt, stride_qph,
    stride_cb, stride_cs, stride_bt, stride_kt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    pos = tl.load(token_pos_ptr + t)
    if SPARSE:
        total = num_topk          # walk the token's top-k list
    else:
        total = pos + 1           # walk positions 0..pos
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, total)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = heads < num_heads
    l_mask = offs_l < KV_LORA
    r_mask = offs_r < ROPE
    qn = tl.load(qn_ptr + t * stride_qnt + heads[:, None] * stride_qnh + offs_l[None, :],
                 mask=h_mask[:, None] & l_mask[None, :], other=0.0)            # [BLOCK_H, BLOCK_L]
    qp = tl.load(qp_ptr + t * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :],
                 mask=h_mask[:, None] & r_mask[None, :], other=0.0)            # [BLOCK_H, BLOCK_R]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        if SPARSE:
            key_pos = tl.load(topk_ptr + t * stride_kt + idx, mask=idx < hi, other=-1)
            valid = (idx < hi) & (key_pos >= 0) & (key_pos <= pos)
        else:
            key_pos = idx
            valid = idx < hi
        key_pos = tl.where(valid, key_pos, 0)
        blk = tl.load(block_tables_ptr + seq * stride_bt + key_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs       # [BLOCK_N] row pointers
        latent = tl.load(row[:, None] + offs_l[None, :], mask=valid[:, None] & l_mask[None, :],
                         other=0.0).to(qn.dtype)                                  # [BLOCK_N, BLOCK_L]
        k_pe = tl.load(row[:, None] + KV_LORA + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                       other=0.0).to(qp.dtype)                                    # [BLOCK_N, BLOCK_R]
        s = (mma(qn, tl.trans(latent), UPCAST) + mma(qp, tl.trans(k_pe), UPCAST)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))                           # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # sparse tiles may be all padding
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(latent.dtype), latent, UPCAST)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :],
             out, mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh + split, lse, mask=h_mask)


def mla_attention_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         query_start_loc: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
                         max_seq_len: int | None = None, *, num_splits: int | None = None) -> torch.Tensor:
    """Triton :func:`kernels.mla_attention.mla_attention_ref` (same arguments and result).

    Args:
        q_nope: ``[T, H, kv_lora_rank]`` (heads/tokens may be strided, last dim contiguous).
        q_pe: ``[T, H, qk_rope_head_dim]`` (e.g. a slice of q).
        latent_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, cast to
            ``q_nope.dtype`` on load.
        block_tables, seq_lens, scale, query_start_loc, topk_indices: see the reference.
        max_seq_len: host-side bound on ``seq_lens`` (dense case); sizes the split plan only.
        num_splits: force this many splits of the context (or of the top-k list).

    Returns:
        ``[T, H, kv_lora_rank]`` in ``q_nope.dtype``.
    """
    check_launchable(q_nope, q_pe, latent_cache, block_tables, seq_lens)
    num_tokens, num_heads, kv_lora_rank = q_nope.shape
    rope_dim = q_pe.shape[-1]
    _, block_size, row_width = latent_cache.shape
    assert row_width == kv_lora_rank + rope_dim, f"latent row {row_width} != {kv_lora_rank} + {rope_dim}"
    assert q_pe.shape[:2] == (num_tokens, num_heads), f"q_pe {tuple(q_pe.shape)} vs q_nope {tuple(q_nope.shape)}"
    assert latent_cache.stride(-1) == 1, f"latent_cache strides {latent_cache.stride()}: rows must be contiguous"
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    token_seq, token_pos = token_metadata(query_start_loc, seq_lens, num_tokens)
    sparse = topk_indices is not None
    if sparse:
        assert topk_indices.shape[0] == num_tokens, f"topk_indices {tuple(topk_indices.shape)} vs {num_tokens} tokens"
        topk_indices = topk_indices.contiguous()
        max_keys = topk_indices.shape[1]
    else:
        max_keys = max_seq_len or block_tables.shape[1] * block_size
    block_l = pow2(kv_lora_rank, 16)
    block_h = min(pow2(num_heads, 16), 16 if block_l >= 256 else 64)
    block_n = 32 if block_l >= 256 else 64
    head_tiles = triton.cdiv(num_heads, block_h)
    splits, keys_per_split = choose_splits(max_keys, num_tokens * head_tiles, block_n, num_splits)
    part, lse, stride_split = split_buffers(num_tokens, num_heads, splits, kv_lora_rank, out)
    topk_arg = topk_indices if sparse else token_pos  # any int tensor when dense (never read)
    _mla_attention_kernel[(num_tokens, head_tiles, splits)](
        q_nope, q_pe, latent_cache, block_tables, token_seq, token_pos, topk_arg, part, lse,
        scale * _LOG2E, keys_per_split, num_heads, topk_arg.shape[-1] if sparse else 0,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), topk_arg.stride(0),
        part.stride(0), part.stride(1), stride_split, lse.stride(0), lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=rope_dim, BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=block_l, BLOCK_R=pow2(rope_dim, 16), SPARSE=sparse, UPCAST=interpreting(),
        num_warps=8 if block_l >= 256 else 4)
    combine_splits(part, lse, out)
    return out
