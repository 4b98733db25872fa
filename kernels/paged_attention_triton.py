"""Triton paged-cache store and paged GQA attention: split-K decode, query-tiled prefill.

Decode (one query per sequence) runs one program per (sequence, KV head, context split): the query
heads of one KV group are the rows of its tiles, so a K/V row is read once per group, and long
contexts split over programs when the batch leaves the GPU idle. Prefill and mixed steps run one
program per (sequence, tile of query tokens, KV head): the MMA rows are ``BLOCK_Q`` query tokens x
the ``GROUP`` heads of the KV head, packed (3 heads per KV head fill 63 of 64 rows, not 3 of 16),
so each K/V tile is read once per tile of queries instead of once per query token
(FlashAttention-2's tiling on a paged cache; vLLM's prefix-prefill kernel packs GQA the same way).
Contracts: :mod:`kernels.paged_attention` references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import (check_launchable, choose_splits, combine_splits, interpreting, mma, pow2,
                                  split_buffers, token_metadata)

_LOG2E = 1.4426950408889634


@triton.jit
def _store_rows_kernel(src_ptr, cache_ptr, slot_ptr, stride_src, stride_cb, stride_cs, ROW,
                       BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    # Grid (T, cdiv(ROW, BLOCK_R)); a negative slot means "padding token, do not store".
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = (offs < ROW) & ((slot + offs * 0) >= 0)  # vector-shaped: the interpreter rejects a scalar in a mask
    row = tl.load(src_ptr + t * stride_src + offs, mask=mask, other=0.0)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs
    tl.store(dst, row, mask=mask)


def store_cache_triton(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton :func:`kernels.paged_attention.store_cache_ref`; slots ``< 0`` are skipped.

    Args:
        values: ``[num_tokens, *row_shape]``.
        cache: ``[num_blocks, block_size, *row_shape]``; each slot's row must be contiguous.
        slot_mapping: ``[num_tokens]`` int flat slots.
    """
    check_launchable(values, cache, slot_mapping)
    num_tokens = values.shape[0]
    assert values.shape[1:] == cache.shape[2:], f"rows {tuple(values.shape)} vs cache {tuple(cache.shape)}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} vs {num_tokens} tokens"
    cache3 = cache.view(cache.shape[0], cache.shape[1], -1)  # raises if a slot's row is not contiguous
    src = values.reshape(num_tokens, -1)
    if src.stride(-1) != 1:
        src = src.contiguous()
    row = cache3.shape[2]
    if num_tokens == 0 or row == 0:
        return
    block_r = min(pow2(row), 1024)
    _store_rows_kernel[(num_tokens, triton.cdiv(row, block_r))](
        src, cache3, slot_mapping.contiguous(), src.stride(0), cache3.stride(0), cache3.stride(1), row,
        BLOCK_SIZE=cache.shape[1], BLOCK_R=block_r, num_warps=4)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton :func:`kernels.paged_attention.store_kv_ref` (two row scatters); slots ``< 0`` are skipped.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int flat slots.
    """
    store_cache_triton(key, k_cache, slot_mapping)
    store_cache_triton(value, v_cache, slot_mapping)


@triton.jit
def _kv_tile(k_ptr, v_ptr, table_ptr, offs_n, n_mask, kvh, offs_d, d_mask,
             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr):
    """K and V rows ``[BLOCK_N, BLOCK_D]`` of KV head ``kvh`` at logical positions ``offs_n``,
    through one sequence's block table (``table_ptr``): position -> physical block and offset."""
    blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_blk = offs_n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + blk[:, None] * stride_kb + in_blk[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * stride_vb + in_blk[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr, out_ptr, lse_ptr,
    qk_scale, keys_per_split, D,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (T, num_kv_heads, num_splits). Rows = the GROUP query heads sharing KV head `kvh`.
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    kv_len = tl.load(token_pos_ptr + t) + 1            # causal: keys 0..pos
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)      # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k, v = _kv_tile(k_ptr, v_ptr, block_tables_ptr + seq * stride_bt, offs_n, n_mask, kvh, offs_d, d_mask,
                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)                                     # [BLOCK_N, BLOCK_D]
        s = mma(q, tl.trans(k), UPCAST) * qk_scale       # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))          # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    # An empty split (lo >= kv_len) reports lse = -inf and zeros; the combine skips it.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
             out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + t * stride_lt + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    qk_scale, D,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (B, cdiv(max_query_len, BLOCK_Q), num_kv_heads). Row r of the tile: query token
    # first + r // GROUP of the sequence, query head kvh * GROUP + r % GROUP.
    seq = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_Q
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if first >= q_len:   # past this sequence's queries (the grid is sized by the longest)
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = first + offs_m // GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < D
    heads = kvh * GROUP + offs_m % GROUP
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_D]
    q_pos = seq_len - q_len + q_idx                                             # causal: keys 0..q_pos
    kv_hi = seq_len - q_len + tl.minimum(first + BLOCK_Q, q_len)                # last query's position + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_hi
        k, v = _kv_tile(k_ptr, v_ptr, block_tables_ptr + seq * stride_bt, offs_n, n_mask, kvh, offs_d, d_mask,
                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)                                     # [BLOCK_N, BLOCK_D]
        s = mma(q, tl.trans(k), UPCAST) * qk_scale                              # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out, mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
                           scale: float, max_query_len: int, max_seq_len: int, *,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton :func:`kernels.paged_attention.paged_attention_ref` (varlen prefill and decode, GQA).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any block size;
            head_dim contiguous); cast to ``query.dtype`` on load.
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context length after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts; None means decode (one query per sequence).
        scale: softmax scale.
        max_query_len: host-side maximum query length: above 1 the query-tiled prefill kernel
            runs (its grid is sized by it), at 1 the split-K decode kernel.
        max_seq_len: host-side maximum of ``seq_lens``; sizes the decode split-K plan.
        num_splits: decode: force this many context splits (default: split only long, small batches).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    check_launchable(query, k_cache, v_cache, block_tables, seq_lens)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads vs {num_kv_heads} kv heads"
    assert k_cache.shape[-1] == head_dim and v_cache.shape == k_cache.shape, \
        f"q {tuple(query.shape)} k {tuple(k_cache.shape)} v {tuple(v_cache.shape)}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, \
        f"k/v cache strides {k_cache.stride()} {v_cache.stride()}: head_dim must be contiguous"
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_n = 64 if block_size >= 64 and head_dim <= 128 else 32
    if query_start_loc is not None and max_query_len > 1:
        _prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out, group,
                 block_n)
        return out
    token_seq, token_pos = token_metadata(query_start_loc, seq_lens, num_tokens)
    splits, keys_per_split = choose_splits(max_seq_len, num_tokens * num_kv_heads, block_n, num_splits)
    part, lse, stride_split = split_buffers(num_tokens, num_heads, splits, head_dim, out)
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, token_seq, token_pos, part, lse,
        scale * _LOG2E, keys_per_split, head_dim,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), stride_split,
        lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_G=pow2(group, 16), BLOCK_N=block_n,
        BLOCK_D=pow2(head_dim, 16), UPCAST=interpreting(), num_warps=4)
    combine_splits(part, lse, out)
    return out


def _prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float, max_query_len: int,
             out: torch.Tensor, group: int, block_n: int) -> None:
    """The query-tiled kernel: ``BLOCK_M`` rows = ``BLOCK_Q`` query tokens x ``group`` heads."""
    num_seqs = seq_lens.shape[0]
    head_dim, num_kv_heads = query.shape[2], k_cache.shape[2]
    block_m = max(16, min(64, pow2(group * max_query_len)), pow2(group))
    block_q = block_m // group
    _paged_prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, head_dim,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=pow2(head_dim, 16), UPCAST=interpreting(), num_warps=4)
