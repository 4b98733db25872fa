"""DSA indexer: Triton logits vs reference, top-k selection, reference vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id, make_block_tables, query_start_loc_of, slots_of
from kernels.indexer import indexer_scores_ref, indexer_topk, select_topk
from kernels.paged_attention import store_cache_ref

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


@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,head_dim,dtype", list(params()))
def test_indexer_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, head_dim, dtype):
    from kernels.indexer_triton import indexer_scores_triton

    q, weights, k_cache, block_tables, lens, qsl, _ = build(block_size, seq_lens, query_lens, num_heads, head_dim,
                                                             dtype)
    expected = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens))
    actual = indexer_scores_triton(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens))
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "causal -inf pattern differs"
    finite = torch.isfinite(expected)
    # Logits sum H*D products; bf16 inputs are exact in fp32, so both dtypes use the fp32-level bound.
    assert_close(actual[finite], expected[finite], torch.float32, scale=5.0)


@pytest.mark.parametrize("topk", [4, 64], ids=["B2-T12-H4-D32-fp32-topk4", "B2-T12-H4-D32-fp32-topk64-exceeds"])
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


def test_indexer_reference_matches_per_token_loop():
    seq_lens, query_lens = [18, 33], [3, 4]
    q, weights, k_cache, block_tables, lens, qsl, keys = build(16, seq_lens, query_lens, 3, 16, torch.float32)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 33)
    t = 0
    for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)):
        for i in range(qlen):
            pos = length - qlen + i
            naive = torch.full((33,), float("-inf"), dtype=torch.float64)
            for s in range(pos + 1):
                dots = q[t].double() @ keys[b][s].double()                        # [H]
                naive[s] = (weights[t].double() * dots.clamp(min=0)).sum()
            torch.testing.assert_close(logits[t].double(), naive, atol=1e-5, rtol=1e-5)
            t += 1
