"""Triton FlashAttention step of :func:`kernels.mla_prefill.mla_prefill_dense`: one expanded key chunk.

One program per (tile of BLOCK_M query rows of one sequence, sequence, head): the rows' ``q_nope``
and ``q_pe`` stay in registers while the chunk's keys stream through in tiles of BLOCK_N
(``k_nope`` and ``v`` per head from the expanded chunk, ``k_pe`` shared by all heads), with the
online softmax of FlashAttention-2 in base 2. The running state (``acc``, row max, denominator) is
read at the start and written back at the end, so successive chunks continue one softmax. Key
tiles past the rows' last position are never loaded (causal early exit); offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable, interpreting, mma, pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_prefill_chunk_kernel(
    qn_ptr, qp_ptr, kv_ptr, kpe_ptr, acc_ptr, max_ptr, den_ptr, qsl_ptr, seq_lens_ptr,
    qk_scale, chunk_lo, chunk_len,
    stride_qnt, stride_qnh, stride_qpt, stride_qph,
    stride_kvb, stride_kvn, stride_kvh, stride_peb, stride_pen,
    stride_at, stride_ah, stride_mt,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    first = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - first
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < q_len
    q_pos = seq_len - q_len + rows                                               # [BLOCK_M]
    last_pos = seq_len - q_len + tl.minimum((m_tile + 1) * BLOCK_M, q_len) - 1
    # Keys of this chunk the rows see: positions chunk_lo .. min(chunk end, seq_len, last_pos + 1) - 1.
    num_keys = tl.minimum(tl.minimum(chunk_len, seq_len - chunk_lo), last_pos + 1 - chunk_lo)
    num_keys = tl.where(m_tile * BLOCK_M < q_len, num_keys, 0)

    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    tokens = first + rows
    qn = tl.load(qn_ptr + tokens[:, None] * stride_qnt + head * stride_qnh + offs_dn[None, :],
                 mask=row_mask[:, None] & (offs_dn[None, :] < NOPE), other=0.0)              # [M, DN]
    qp = tl.load(qp_ptr + tokens[:, None] * stride_qpt + head * stride_qph + offs_dr[None, :],
                 mask=row_mask[:, None] & (offs_dr[None, :] < ROPE), other=0.0)              # [M, DR]
    state_rows = tokens * stride_mt + head
    m_i = tl.load(max_ptr + state_rows, mask=row_mask, other=float("-inf"))
    l_i = tl.load(den_ptr + state_rows, mask=row_mask, other=0.0)
    acc_ptrs = acc_ptr + tokens[:, None] * stride_at + head * stride_ah + offs_dv[None, :]
    acc_mask = row_mask[:, None] & (offs_dv[None, :] < V)
    acc = tl.load(acc_ptrs, mask=acc_mask, other=0.0)                                        # [M, DV]

    kv_base = kv_ptr + seq * stride_kvb + head * stride_kvh
    for start in range(0, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N).to(tl.int64)
        k_mask = keys < num_keys
        k_nope = tl.load(kv_base + keys[:, None] * stride_kvn + offs_dn[None, :],
                         mask=k_mask[:, None] & (offs_dn[None, :] < NOPE), other=0.0).to(qn.dtype)   # [N, DN]
        k_pe = tl.load(kpe_ptr + seq * stride_peb + keys[:, None] * stride_pen + offs_dr[None, :],
                       mask=k_mask[:, None] & (offs_dr[None, :] < ROPE), other=0.0).to(qp.dtype)     # [N, DR]
        s = (mma(qn, tl.trans(k_nope), UPCAST) + mma(qp, tl.trans(k_pe), UPCAST)) * qk_scale          # [M, N]
        visible = k_mask[None, :] & (chunk_lo + keys[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # rows that see no key of this tile yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        value = tl.load(kv_base + keys[:, None] * stride_kvn + NOPE + offs_dv[None, :],
                        mask=k_mask[:, None] & (offs_dv[None, :] < V), other=0.0).to(qn.dtype)        # [N, DV]
        acc = acc * alpha[:, None] + mma(p.to(value.dtype), value, UPCAST)
        m_i = m_new
    tl.store(max_ptr + state_rows, m_i, mask=row_mask)
    tl.store(den_ptr + state_rows, l_i, mask=row_mask)
    tl.store(acc_ptrs, acc, mask=acc_mask)


def attend_chunk_triton(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, chunk_lo: int,
                        state, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        max_query_len: int) -> None:
    """Fold one expanded key chunk into the running softmax ``state`` (in place).

    Args:
        q_nope: ``[T, H, nope]`` and ``q_pe``: ``[T, H, rope]`` packed queries (last dim contiguous).
        kv: ``[B, C, H, nope + v]`` the chunk's keys (positions ``chunk_lo..chunk_lo+C-1`` of every
            sequence) expanded through ``kv_b_proj``; ``k_pe``: ``[B, C, rope]``.
        chunk_lo: position of the chunk's first key.
        state: :class:`kernels.mla_prefill.PrefillState`; its ``row_max`` is in base-2 units (this
            kernel's exclusively: a call sequence never mixes the kernel and the reference).
        query_start_loc: ``[B + 1]``; seq_lens: ``[B]`` (device); max_query_len: host ``max(q_len)``.
        scale: softmax scale.
    """
    check_launchable(q_nope, q_pe, kv, k_pe, seq_lens)
    num_tokens, num_heads, nope_dim = q_nope.shape
    num_seqs, chunk_len, _, kv_dim = kv.shape
    rope_dim, v_dim = q_pe.shape[-1], kv_dim - nope_dim
    assert kv.stride(-1) == 1 and k_pe.stride(-1) == 1, f"kv {kv.stride()} / k_pe {k_pe.stride()}: rows contiguous"
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    if num_tokens == 0 or chunk_len == 0:
        return
    block_m = 64 if max_query_len >= 64 else pow2(max_query_len, 16)
    block_n = 32 if max(nope_dim, v_dim) > 64 else 64
    _mla_prefill_chunk_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_heads)](
        q_nope, q_pe, kv, k_pe, state.acc, state.row_max, state.denom, query_start_loc, seq_lens,
        scale * _LOG2E, chunk_lo, chunk_len,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), k_pe.stride(0), k_pe.stride(1),
        state.acc.stride(0), state.acc.stride(1), state.row_max.stride(0),
        NOPE=nope_dim, ROPE=rope_dim, V=v_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DN=pow2(nope_dim, 16), BLOCK_DR=pow2(rope_dim, 16), BLOCK_DV=pow2(v_dim, 16),
        UPCAST=interpreting(), num_warps=4 if block_m <= 32 else 8)
