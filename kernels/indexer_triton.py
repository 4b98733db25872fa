"""Triton DSA indexer logits over the paged key cache; contract :func:`kernels.indexer.indexer_scores_ref`.

One program per (query token, tile of BLOCK_N key positions): the key tile is scored against every
head (head tiles of up to 64 rows), ReLU'd, weighted and summed over heads in registers; a tile
wholly after the token's position writes ``-inf`` without reading keys. Offsets are int64.
Top-k stays in torch (:func:`kernels.indexer.select_topk`), one bounded row chunk at a time
(:func:`kernels.indexer.indexer_topk`). Packed fp8 keys
(:func:`kernels.indexer.quantize_index_keys`) are read in chunks of at most one scale group (128
dims): with float queries the chunk is dequantized (fp8 values times the group's float32 scale) and
multiplied in the query's dtype; with fp8 queries (:func:`kernels.indexer.quantize_index_queries`)
the fp8 values are multiplied directly (fp8 tensor cores on sm89+, else bf16, which holds every
e4m3 value exactly) and the product is scaled by the query's and the key's group scales, as
DeepSeek-V3.2's ``fp8_index`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.indexer import FP8_GROUP, check_fp8_queries, fp8_row_bytes
from shardserve.kernels.triton_utils import check_launchable, interpreting, mma, pow2, token_metadata


@triton.jit
def _indexer_scores_kernel(
    q_ptr, q_scale_ptr, w_ptr, k_ptr, k_scale_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr, out_ptr,
    num_heads, D, width,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_wt, stride_kb, stride_ks, stride_sb, stride_ss,
    stride_bt, stride_ot,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    K_FP8: tl.constexpr, Q_FP8: tl.constexpr, FP8_GROUP: tl.constexpr, FP8_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)            # int64: t * stride_ot passes 2**31 at long contexts
    tile_start = tl.program_id(1) * BLOCK_N
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    pos = tl.load(token_pos_ptr + t)
    valid = (offs_n <= pos) & (offs_n < width)                                   # causal
    # A tile wholly after the row's position only writes -inf: no key is read, no head is scored.
    heads_to_score = tl.where(tile_start <= pos, num_heads, 0)
    blk = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    key_rows = blk * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks              # [BLOCK_N]
    scale_rows = blk * stride_sb + (offs_n % BLOCK_SIZE) * stride_ss            # [BLOCK_N] (fp8 keys)
    logits = tl.zeros([BLOCK_N], tl.float32)
    for h0 in range(0, heads_to_score, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = heads < num_heads
        w = tl.load(w_ptr + t * stride_wt + heads, mask=h_mask, other=0.0).to(tl.float32)
        dots = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):          # with fp8, each chunk lies inside one scale group
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < D
            k = tl.load(k_ptr + key_rows[:, None] + offs_d[None, :],
                        mask=valid[:, None] & d_mask[None, :], other=0.0)        # [BLOCK_N, BLOCK_D]
            q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=h_mask[:, None] & d_mask[None, :], other=0.0)      # [BLOCK_H, BLOCK_D]
            if K_FP8:
                k_scale = tl.load(k_scale_ptr + scale_rows + d0 // FP8_GROUP, mask=valid, other=0.0)
            if Q_FP8:
                q_scale = tl.load(q_scale_ptr + t * stride_qst + heads * stride_qsh + d0 // FP8_GROUP,
                                  mask=h_mask, other=0.0)
                if FP8_DOT:
                    prod = tl.dot(q, tl.trans(k))
                else:
                    prod = mma(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)), UPCAST)
                dots += prod * q_scale[:, None] * k_scale[None, :]
            else:
                if K_FP8:
                    k = k.to(tl.float32) * k_scale[:, None]
                dots += mma(q, tl.trans(k.to(q.dtype)), UPCAST)                  # [BLOCK_H, BLOCK_N]
        logits += tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
    logits = tl.where(valid, logits, float("-inf"))
    tl.store(out_ptr + t * stride_ot + offs_n, logits, mask=offs_n < width)


def _fp8_dot(device: torch.device) -> bool:
    """Whether ``tl.dot`` takes e4m3 operands here (sm89+; never under the interpreter)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (8, 9)


def indexer_scores_triton(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                          max_seq_len: int | None = None, *, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`kernels.indexer.indexer_scores_ref` (same arguments and result).

    Args:
        q: ``[T, H, index_head_dim]`` (last dim contiguous), float or float8_e4m3fn (then with
            ``q_scale`` and an fp8 key cache).
        weights: ``[T, H]``.
        k_cache: ``[num_blocks, block_size, index_head_dim]``, cast to ``q.dtype`` on load; or
            uint8 ``[num_blocks, block_size, fp8_row_bytes(index_head_dim)]`` packed fp8 keys.
        block_tables, seq_lens, query_start_loc, max_seq_len, q_scale: see the reference.

    Returns:
        ``[T, max_seq_len]`` float32 logits, ``-inf`` after each token's position.

    Raises:
        ValueError: see :func:`kernels.indexer.check_fp8_queries`.
    """
    check_launchable(q, weights, k_cache, block_tables, seq_lens)
    capacity = block_tables.shape[1] * k_cache.shape[1]
    width = min(max_seq_len or capacity, capacity)
    token_seq, token_pos = token_metadata(query_start_loc, seq_lens, q.shape[0])
    return score_rows_triton(q, weights, k_cache, block_tables, token_seq, token_pos, width, q_scale=q_scale)


def score_rows_triton(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                      token_seq: torch.Tensor, token_pos: torch.Tensor, width: int, *,
                      q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``R`` query rows against key positions ``0..width-1`` of their own sequences
    (one row chunk of :func:`kernels.indexer.indexer_topk`; contract of
    :func:`kernels.indexer.score_rows_ref`).

    Args:
        q, weights, k_cache, block_tables, q_scale: see :func:`indexer_scores_triton` (``R`` rows).
        token_seq, token_pos: ``[R]`` int sequence and position of each row.
        width: logit columns.

    Returns:
        ``[R, width]`` float32, ``-inf`` after each row's position.
    """
    check_launchable(q, weights, k_cache, block_tables, token_pos)
    check_fp8_queries(q, q_scale, k_cache)
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    k_fp8, q_fp8 = k_cache.dtype == torch.uint8, q_scale is not None
    assert k_cache.shape[-1] == (fp8_row_bytes(head_dim) if k_fp8 else head_dim), \
        f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} vs q {tuple(q.shape)}"
    assert weights.shape == (num_tokens, num_heads), f"weights {tuple(weights.shape)} vs q {tuple(q.shape)}"
    assert k_cache.stride(-1) == 1, f"k_cache strides {k_cache.stride()}: the head dim must be contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    q_scale = q if q_scale is None else q_scale.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or width == 0:
        return out
    token_seq, token_pos = token_seq.to(torch.int32).contiguous(), token_pos.to(torch.int32).contiguous()
    keys, scales = k_cache, k_cache
    if k_fp8:   # one uint8 row per slot: D fp8 values, then float32 scales
        keys = k_cache.view(torch.float8_e4m3fn)
        scales = k_cache.view(torch.float32)[..., head_dim // 4:]
    block_d = min(pow2(head_dim, 32), FP8_GROUP) if k_fp8 else pow2(head_dim, 16)
    block_n = 64
    _indexer_scores_kernel[(num_tokens, triton.cdiv(width, block_n))](
        q, q_scale, weights, keys, scales, block_tables, token_seq, token_pos, out,
        num_heads, head_dim, width,
        q.stride(0), q.stride(1), q_scale.stride(0), q_scale.stride(1), weights.stride(0),
        keys.stride(0), keys.stride(1), scales.stride(0), scales.stride(1), block_tables.stride(0), out.stride(0),
        BLOCK_SIZE=block_size, BLOCK_H=min(pow2(num_heads, 16), 64), BLOCK_N=block_n, BLOCK_D=block_d,
        K_FP8=k_fp8, Q_FP8=q_fp8, FP8_GROUP=FP8_GROUP, FP8_DOT=q_fp8 and _fp8_dot(q.device),
        UPCAST=interpreting(), num_warps=4)
    return out
