"""Paged GQA attention and the paged stores: Triton vs references, references vs dense attention."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import (DTYPES, assert_close, case_id, make_block_tables, query_start_loc_of, slots_of)
from shardserve.kernels.paged_attention import paged_attention_ref, store_cache_ref, store_kv_ref

# (block_size, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, num_splits)
CASES = [
    (16, [1], [1], 2, 2, 16, None),                 # a single token, first position
    (16, [16, 17], [1, 1], 4, 2, 32, None),         # decode ending on / one past a block boundary
    (64, [64, 65, 3], [1, 1, 1], 4, 1, 32, 2),      # block_size 64, MQA, split-K with an empty split
    (16, [37, 5, 20], [4, 5, 1], 4, 2, 24, None),   # varlen: chunked prefill + full prefill + decode, odd D
    (16, [150, 33], [1, 1], 4, 2, 32, 3),           # long context, split-K over 3 splits
    (64, [129], [3], 2, 1, 64, 4),                  # block_size 64, 3 queries (prefill: splits unused)
    (16, [70, 9], [45, 9], 6, 2, 24, None),         # query tiles: 3 heads per KV head, 21 queries a tile, odd D
    (16, [30, 4], [13, 1], 8, 1, 16, None),         # MQA: 8 heads x 8 queries per tile, a decode in the batch
]


def params():
    for bs, lens, qlens, h, hkv, d, splits in CASES:
        for dtype in DTYPES:
            tags = [f"bs{bs}", f"ctx{max(lens)}", f"kv{hkv}", f"split{splits or 'auto'}"]
            yield pytest.param(bs, lens, qlens, h, hkv, d, splits, dtype,
                               id=case_id(len(lens), sum(qlens), h, d, dtype, *tags))


def build(block_size, seq_lens, query_lens, num_heads, num_kv_heads, head_dim, dtype):
    """Contiguous per-sequence K/V, the same K/V paged through random block tables, and queries."""
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)  # garbage everywhere
    v_cache = torch.randn_like(k_cache)
    keys = [torch.randn(length, num_kv_heads, head_dim, dtype=dtype) for length in seq_lens]
    values = [torch.randn(length, num_kv_heads, head_dim, dtype=dtype) for length in seq_lens]
    for b, length in enumerate(seq_lens):
        slots = slots_of(block_tables, b, torch.arange(length), block_size)
        store_kv_ref(keys[b], values[b], k_cache, v_cache, slots)
    query = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype)
    return query, k_cache, v_cache, block_tables, keys, values


def dense_attention(query, keys, values, seq_lens, query_lens, scale):
    """Per sequence, float64: softmax(q k^T * scale + causal mask) v with repeated KV heads."""
    outs, start = [], 0
    for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)):
        q = query[start:start + qlen].double()                                   # [Q, H, D]
        group = q.shape[1] // keys[b].shape[1]
        k = keys[b].double().repeat_interleave(group, dim=1)                      # [S, H, D]
        v = values[b].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = torch.arange(length - qlen, length)[:, None]
        mask = torch.arange(length)[None, :] <= q_pos                             # [Q, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v))
        start += qlen
    return torch.cat(outs)


@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,num_kv_heads,head_dim,num_splits,dtype", list(params()))
def test_paged_attention_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, num_kv_heads,
                                                  head_dim, num_splits, dtype):
    from shardserve.kernels.paged_attention_triton import paged_attention_triton

    query, k_cache, v_cache, block_tables, _, _ = build(block_size, seq_lens, query_lens, num_heads,
                                                        num_kv_heads, head_dim, dtype)
    args = (query, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc_of(query_lens), head_dim ** -0.5, max(query_lens), max(seq_lens))
    expected = paged_attention_ref(*args)
    actual = paged_attention_triton(*args, num_splits=num_splits)
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close(actual, expected, dtype)


REF_CASES = [(16, [1], [1], 1, "single"), (16, [16, 17, 9], [2, 1, 9], 2, "boundary-varlen"),
             (64, [65, 64], [1, 3], 1, "boundary"), (16, [5, 40, 17], [1, 1, 1], 3, "decode-batch"),
             (16, [9, 33, 40, 17, 5], [1, 33, 1, 4, 1], 2, "mixed-decodes-prefills")]


@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_kv_heads,dtype", [
    pytest.param(bs, lens, qlens, kv, dt, id=case_id(len(lens), sum(qlens), 2 * kv, 16, dt, f"bs{bs}", tag))
    for bs, lens, qlens, kv, tag in REF_CASES for dt in DTYPES])
def test_paged_attention_reference_matches_dense(block_size, seq_lens, query_lens, num_kv_heads, dtype):
    """float32: torch's SDPA; bf16: :func:`grouped_attention` (two matmuls, float32 softmax)."""
    num_heads = 2 * num_kv_heads
    query, k_cache, v_cache, block_tables, keys, values = build(block_size, seq_lens, query_lens, num_heads,
                                                                num_kv_heads, 16, dtype)
    out = paged_attention_ref(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens),
                              query_start_loc_of(query_lens), 0.25, max(query_lens), max(seq_lens))
    naive = dense_attention(query, keys, values, seq_lens, query_lens, 0.25)
    assert out.dtype == dtype
    assert_close(out.double(), naive, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_rows_equal_each_sequence_alone(dtype):
    """A step of decodes and prefills is split (:func:`mixed_split`): every sequence's rows equal
    attention over that sequence alone, and a decode never goes through the padded prefill layout."""
    seq_lens, query_lens = [9, 33, 40, 17, 5], [1, 33, 1, 4, 1]
    query, k_cache, v_cache, block_tables, _, _ = build(16, seq_lens, query_lens, 4, 2, 16, dtype)
    step_cache: dict = {}
    out = paged_attention_ref(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens),
                              query_start_loc_of(query_lens), 0.25, max(query_lens), max(seq_lens), step_cache)
    decodes, prefills = step_cache["mixed_split"].parts
    assert decodes.seq_idx.tolist() == [0, 2, 4] and decodes.token_idx.tolist() == [0, 34, 39]
    assert prefills.seq_idx.tolist() == [1, 3] and prefills.max_query_len == 33 and prefills.max_seq_len == 33
    assert "padded_layout" not in decodes.step_cache or dtype == torch.float32
    start = 0
    for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)):
        alone = paged_attention_ref(query[start:start + qlen], k_cache, v_cache, block_tables[b:b + 1],
                                    torch.tensor([length]), query_start_loc_of([qlen]), 0.25, qlen, length)
        assert_close(out[start:start + qlen], alone, dtype)
        start += qlen


@pytest.mark.parametrize("query_lens", [[5], [5, 1], [5, 3]], ids=["one-prefill", "mixed", "two-prefills"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_output_is_contiguous(query_lens, dtype):
    """The compiled forward's opaque attention op is declared to return contiguous ``[T, H, D]``
    rows (its fake kernel); a strided view fails the compiled graph's stride assertion."""
    seq_lens = [8] * len(query_lens)
    query, k_cache, v_cache, block_tables, _, _ = build(16, seq_lens, query_lens, 6, 2, 16, dtype)
    out = paged_attention_ref(query, k_cache, v_cache, block_tables, torch.tensor(seq_lens),
                              query_start_loc_of(query_lens), 0.25, max(query_lens), max(seq_lens))
    assert out.shape == query.shape and out.is_contiguous()


@pytest.mark.parametrize("block_size,dtype", [pytest.param(bs, dt, id=case_id(1, 7, 2, 24, dt, f"bs{bs}"))
                                              for bs in (16, 64) for dt in DTYPES])
def test_store_kv_kernel_matches_reference(block_size, dtype):
    from shardserve.kernels.paged_attention_triton import store_kv_triton

    num_blocks = 5
    slots = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 5, 2, num_blocks * block_size - 1, 17])
    key = torch.randn(7, 2, 24, dtype=dtype)
    value = torch.randn(7, 2, 24, dtype=dtype)
    caches = [torch.randn(num_blocks, block_size, 2, 24, dtype=dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    store_kv_ref(key, value, ref_k, ref_v, slots)
    store_kv_triton(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0], ref_k) and torch.equal(caches[1], ref_v)


def test_store_cache_kernel_skips_padding_slots():
    """Rows of any width (latent 40 + rope 8 here); slot -1 (a padding token) writes nothing."""
    from shardserve.kernels.paged_attention_triton import store_cache_triton

    cache = torch.randn(3, 16, 48)
    expected = cache.clone()
    rows = torch.randn(4, 48)
    slots = torch.tensor([5, -1, 16, 47])
    store_cache_ref(rows[slots >= 0], expected, slots[slots >= 0])
    store_cache_triton(rows, cache, slots)
    assert torch.equal(cache, expected)
    torch.testing.assert_close(expected.view(-1, 48)[47], rows[3])
