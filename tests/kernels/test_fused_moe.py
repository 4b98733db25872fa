"""Fused MoE: Triton vs the per-expert reference, the reference vs a per-token loop, and moe_align.

Test ids reuse ``B{}-T{}-H{}-D{}``: H is the number of experts, D the hidden size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.fused_moe import fused_moe_ref, moe_align

# (num_tokens, hidden, intermediate, num_experts, top_k, block_m, unused_expert, dropped_ids)
CASES = [
    (1, 32, 16, 4, 2, None, None, False),      # a single token: only 2 of 4 experts get rows
    (9, 48, 40, 4, 2, None, 2, True),          # odd sizes, expert 2 gets no tokens, ids -1 / E dropped
    (33, 64, 32, 4, 3, 16, 0, False),          # several row tiles per expert, expert 0 unused
    (5, 16, 24, 6, 1, None, None, False),      # top-1 routing
]


def make_inputs(num_tokens, hidden, inter, num_experts, top_k, unused_expert, dropped_ids, dtype):
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter) * inter ** -0.5).to(dtype)
    experts = [e for e in range(num_experts) if e != unused_expert]
    ids = torch.stack([torch.tensor(experts)[torch.randperm(len(experts))[:top_k]] for _ in range(num_tokens)])
    if dropped_ids:
        ids[0, -1] = -1               # expert owned by another rank
        ids[-1, 0] = num_experts      # HF's "no expert" id
    weights = torch.rand(num_tokens, top_k)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,block_m,unused_expert,dropped_ids,dtype", [
    pytest.param(*case, dt, id=case_id(1, case[0], case[3], case[1], dt, f"I{case[2]}", f"k{case[4]}",
                                       f"unused{case[6]}", "dropped" if case[7] else "all"))
    for case in CASES for dt in DTYPES])
def test_fused_moe_kernel_matches_reference(num_tokens, hidden, inter, num_experts, top_k, block_m, unused_expert,
                                            dropped_ids, dtype):
    from shardserve.kernels.fused_moe_triton import fused_moe_triton

    x, w13, w2, weights, ids = make_inputs(num_tokens, hidden, inter, num_experts, top_k, unused_expert,
                                           dropped_ids, dtype)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    actual = fused_moe_triton(x, w13, w2, weights, ids, block_m=block_m)
    assert actual.shape == x.shape and actual.dtype == dtype
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_moe_split_k_matches_reference(dtype):
    """K split over 3 programs in both GEMMs (partial sums, then SiLU-mul / the token sum), odd sizes
    and dropped ids; and the decode config splits on its own when the grid is small."""
    from shardserve.kernels.fused_moe_triton import fused_moe_triton, moe_config

    x, w13, w2, weights, ids = make_inputs(5, 200, 72, 4, 2, 1, True, dtype)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    assert_close(fused_moe_triton(x, w13, w2, weights, ids, split_k=3), expected, dtype)
    assert moe_config(2, 4, 72, 1024, None, x.device)["split_k"] > 1


def test_fused_moe_reference_regimes_agree(monkeypatch):
    """The pair-wise reference (graph-safe decode-sized steps: no host sync), also one pair per
    chunk, == the per-expert form (long steps, and every step that need not be graph-safe: CPU)."""
    import importlib

    module = importlib.import_module("shardserve.kernels.fused_moe")
    x, w13, w2, weights, ids = make_inputs(9, 48, 40, 4, 2, 2, True, torch.float64)
    pairwise = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids, graph_safe=False), pairwise)
    monkeypatch.setattr(module, "PAIRWISE_CHUNK_BYTES", 1)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), pairwise)
    monkeypatch.setattr(module, "PAIRWISE_MAX_TOKENS", 0)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), pairwise)


def test_fused_moe_reference_matches_per_token_loop():
    x, w13, w2, weights, ids = make_inputs(7, 24, 12, 5, 2, 3, True, torch.float64)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    for t in range(7):
        naive = torch.zeros(24, dtype=torch.float64)
        for j in range(2):
            e = int(ids[t, j])
            if 0 <= e < 5:
                gate, up = w13[e, :12] @ x[t], w13[e, 12:] @ x[t]
                naive += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(out[t], naive)


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[0, 3], [3, -1], [1, 0], [3, 4]])        # 8 pairs, 4 experts; -1 and 4 dropped
    sorted_ids, block_expert = moe_align(ids, 4, 4)
    pad = ids.numel()
    assert block_expert.tolist()[:3] == [0, 1, 3] and all(e == -1 for e in block_expert.tolist()[3:])
    tiles = sorted_ids.view(-1, 4).tolist()
    assert tiles[:3] == [[0, 5, pad, pad], [4, pad, pad, pad], [1, 2, 6, pad]]
    assert all(v == pad for tile in tiles[3:] for v in tile)
