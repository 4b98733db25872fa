"""DSA indexer: Triton logits vs reference, top-k selection, reference vs a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id, make_block_tables, query_start_loc_of, slots_of
from shardserve.kernels.indexer import (dequantize_index_keys, fp8_row_bytes, indexer_scores_ref, indexer_topk,
                             quantize_index_keys, select_topk)
from shardserve.kernels.paged_attention import store_cache_ref

# (block_size, seq_lens, query_lens or None for decode, num_heads, head_dim)
CASES = [
    (16, [1], None, 2, 32),                    # a single token
    (16, [16, 17, 5], None, 4, 32),            # block boundary and one past it, odd length
    (64, [64, 65], None, 3, 64),               # block_size 64
    (16, [40, 7], [5, 7], 2, 32),              # varlen: chunked prefill + full prefill
    (16, [70], None, 80, 16),                  # more heads than one head tile (two tiles of 64)
]


def build(block_size, seq_lens, query_lens, num_heads, head_dim, dtype):
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    k_cache = torch.randn(num_blocks, block_size, head_dim, dtype=dtype)
    keys = [torch.randn(length, head_dim, dtype=dtype) for length in seq_lens]
    for b, length in enumerate(seq_lens):
        store_cache_ref(keys[b], k_cache, slots_of(block_tables, b, torch.arange(length), block_size))
    num_tokens = len(seq_lens) if query_lens is None else sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    weights = torch.randn(num_tokens, num_heads) * num_heads ** -0.5
    qsl = None if query_lens is None else query_start_loc_of(query_lens)
    return q, weights, k_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, keys


def params():
    for bs, lens, qlens, h, d in CASES:
        for dtype in DTYPES:
            num_tokens = sum(qlens) if qlens else len(lens)
            yield pytest.param(bs, lens, qlens, h, d, dtype,
                               id=case_id(len(lens), num_tokens, h, d, dtype, f"bs{bs}", f"ctx{max(lens)}"))


@pytest.mark.parametrize("cache", ["model-dtype", "fp8"])
@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,head_dim,dtype", list(params()))
def test_indexer_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, head_dim, dtype, cache):
    from shardserve.kernels.indexer_triton import indexer_scores_triton

    make = build if cache == "model-dtype" else build_fp8
    q, weights, k_cache, block_tables, lens, qsl, _ = make(block_size, seq_lens, query_lens, num_heads, head_dim,
                                                            dtype)
    expected = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens))
    actual = indexer_scores_triton(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens))
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "causal -inf pattern differs"
    finite = torch.isfinite(expected)
    # Model-dtype keys: logits sum H*D products and bf16 inputs are exact in fp32, so both dtypes use
    # the fp32-level bound. fp8 keys: the kernel multiplies dequantized keys rounded to the query's
    # dtype (the tensor-core operand dtype), so the bound is that dtype's.
    assert_close(actual[finite], expected[finite], torch.float32 if cache == "model-dtype" else dtype, scale=5.0)


@pytest.mark.parametrize("topk", [4, 64, 2048], ids=["B2-T12-H4-D32-fp32-topk4", "B2-T12-H4-D32-fp32-topk64-exceeds",
                                                     "B2-T12-H4-D32-fp32-topk2048-deepseek"])
def test_indexer_topk_kernel_selects_reference_best(topk, monkeypatch):
    """Top-k through the Triton logits picks keys the reference also ranks in its top-k."""
    q, weights, k_cache, block_tables, lens, qsl, _ = build(16, [40, 7], [5, 7], 4, 32, torch.float32)
    expected_logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 40)
    monkeypatch.setenv("SHARDSERVE_KERNELS", "triton")
    chosen = indexer_topk(q, weights, k_cache, block_tables, lens, topk, qsl, 40)
    assert chosen.shape == (12, topk) and chosen.dtype == torch.int32
    num_valid = torch.isfinite(expected_logits).sum(-1)                          # [T]
    for t in range(12):
        picked = chosen[t][chosen[t] >= 0].long()
        assert picked.numel() == min(topk, int(num_valid[t])), (t, picked)
        assert torch.all(chosen[t][picked.numel():] == -1), "padding must trail"
        kth_best = expected_logits[t].topk(picked.numel()).values[-1]
        assert torch.all(expected_logits[t][picked] >= kth_best - 1e-4), (t, picked)


def test_select_topk_pads_rows_with_few_keys():
    inf = float("-inf")
    logits = torch.tensor([[0.5, inf, inf], [0.1, 0.9, 0.3], [inf, inf, inf]])
    assert select_topk(logits, 2).tolist() == [[0, -1], [1, 2], [-1, -1]]
    assert select_topk(logits, 5).tolist() == [[0, -1, -1, -1, -1], [1, 2, 0, -1, -1], [-1, -1, -1, -1, -1]]
    assert select_topk(logits[:, :0], 3).tolist() == [[-1] * 3] * 3


def per_token_logits(q, weights, keys, seq_lens, query_lens, width) -> torch.Tensor:
    """Float64 oracle: for each packed query token, a loop over its own sequence's visible keys
    (``keys[b]`` ``[len_b, D]``); ``-inf`` after the token's position."""
    naive = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float64)
    t = 0
    for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)):
        for i in range(qlen):
            pos = length - qlen + i
            for s in range(pos + 1):
                dots = q[t].double() @ keys[b][s].double()                        # [H]
                naive[t, s] = (weights[t].double() * dots.clamp(min=0)).sum()
            t += 1
    return naive


def test_indexer_reference_matches_per_token_loop():
    seq_lens, query_lens = [18, 33], [3, 4]
    q, weights, k_cache, block_tables, lens, qsl, keys = build(16, seq_lens, query_lens, 3, 16, torch.float32)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 33)
    torch.testing.assert_close(logits.double(), per_token_logits(q, weights, keys, seq_lens, query_lens, 33),
                               atol=1e-5, rtol=1e-5)

# ---- fp8 key cache (DeepSeek-V3.2 format: e4m3 values + a power-of-two float32 scale per 128 dims)

def _fp8_oracle(row: torch.Tensor) -> torch.Tensor:
    """One key row quantized and dequantized group by group with plain Python scalars (ue8m0 scale:
    the smallest power of two with amax / scale <= 448)."""
    out = torch.empty(row.shape[0], dtype=torch.float32)
    for start in range(0, row.shape[0], 128):
        group = row[start:start + 128].float()
        amax = max(float(group.abs().max()), 1e-30)
        scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
        out[start:start + 128] = (group / scale).to(torch.float8_e4m3fn).float() * scale
    return out


@pytest.mark.parametrize("head_dim", [32, 128, 200])
def test_fp8_key_rows_match_per_group_quantization(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(6, head_dim, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 0.0])[:, None]
    keys[3, :5] = 1e4                                          # one outlier sets its group's scale
    rows = quantize_index_keys(keys)
    assert rows.dtype == torch.uint8 and rows.shape == (6, fp8_row_bytes(head_dim))
    assert fp8_row_bytes(128) == 132                           # DeepSeek-V3.2: 128 fp8 bytes + 1 scale
    decoded = dequantize_index_keys(rows, head_dim)
    expected = torch.stack([_fp8_oracle(row) for row in keys])
    assert torch.equal(decoded, expected)
    # e4m3 rounding: 2^-4 relative for normals, half the smallest subnormal step otherwise.
    scale = rows[:, head_dim:].contiguous().view(torch.float32).repeat_interleave(128, -1)[:, :head_dim]
    assert ((decoded - keys).abs() <= keys.abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()


def test_fp8_rows_need_float32_aligned_scales():
    with pytest.raises(ValueError, match="% 4"):
        fp8_row_bytes(30)


def build_fp8(block_size, seq_lens, query_lens, num_heads, head_dim, dtype):
    """:func:`build` with the keys stored as packed fp8 rows (the float keys are returned too)."""
    q, weights, _, block_tables, lens, qsl, keys = build(block_size, seq_lens, query_lens, num_heads, head_dim,
                                                         torch.float32)
    num_blocks = int(block_tables.max()) + 1
    k_cache = torch.zeros(num_blocks, block_size, fp8_row_bytes(head_dim), dtype=torch.uint8)
    for b, length in enumerate(seq_lens):
        store_cache_ref(quantize_index_keys(keys[b]), k_cache, slots_of(block_tables, b, torch.arange(length),
                                                                         block_size))
    return q.to(dtype), weights, k_cache, block_tables, lens, qsl, keys


def test_fp8_indexer_reference_scores_the_dequantized_keys():
    """Scores over the packed fp8 cache == the per-token loop over the oracle's dequantized keys."""
    seq_lens, query_lens = [18, 33], [3, 4]
    q, weights, k_cache, block_tables, lens, qsl, keys = build_fp8(16, seq_lens, query_lens, 3, 32, torch.float32)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 33)
    dequantized = [torch.stack([_fp8_oracle(row) for row in seq_keys]) for seq_keys in keys]
    torch.testing.assert_close(logits.double(), per_token_logits(q, weights, dequantized, seq_lens, query_lens, 33),
                               atol=1e-5, rtol=1e-5)
