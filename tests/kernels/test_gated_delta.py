"""Gated delta rule: the references vs transformers' Qwen3-Next functions (the oracle), chunked vs
recurrent, and the Triton kernels vs the references on packed sequences over a slot pool."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import assert_close, case_id
from shardserve.kernels.gated_delta import gated_delta_chunk_ref, gated_delta_recurrent_ref

# (sequence lengths, key heads, value heads, K, V): a one-token decode beside a 70-token sequence
# (two chunks, the second partial), odd head dims (masked tails), value heads grouped over keys.
CASES = [([1, 70, 5], 2, 4, 16, 8), ([3, 1], 1, 3, 24, 20)]
# The interpreter runs the kernels token by token: decode/verify-sized sequences for the recurrent
# kernel, one sequence over two chunks for the chunked one; bf16 inputs on the odd shape.
RECURRENT_CASES = [(([1, 4, 2], 2, 4, 16, 8), torch.float32), (([3, 1], 1, 3, 24, 20), torch.float32),
                   (([3, 1], 1, 3, 24, 20), torch.bfloat16)]
CHUNK_CASES = [(([70, 5], 2, 4, 16, 8), torch.float32), (([3, 1], 1, 3, 24, 20), torch.bfloat16)]


def make_inputs(lens, num_k_heads, num_v_heads, k_dim, v_dim, dtype=torch.float32, num_slots=6):
    """Packed inputs as the model builds them (L2-normalized q/k, q scaled, g <= 0, beta in (0, 1))
    and a pool with random states in shuffled slots."""
    total = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(total, num_k_heads, k_dim), dim=-1) * k_dim ** -0.5
    k = torch.nn.functional.normalize(torch.randn(total, num_k_heads, k_dim), dim=-1)
    v = torch.randn(total, num_v_heads, v_dim)
    g = -torch.nn.functional.softplus(torch.randn(total, num_v_heads)) * torch.rand(num_v_heads) * 2
    beta = torch.rand(total, num_v_heads)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    state = torch.randn(num_slots, num_v_heads, k_dim, v_dim) * 0.3
    slots = torch.randperm(num_slots)[:len(lens)].to(torch.int32)
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [cu, state, slots]


def per_sequence_oracle(fn, q, k, v, g, beta, cu, state, slots):
    """transformers' function run on one sequence at a time (batch 1, its own initial state)."""
    outs, finals = [], []
    for b in range(len(slots)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        o, final = fn(q[rows][None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
                      initial_state=state[int(slots[b])][None].clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=False)
        outs.append(o[0])
        finals.append(final[0])
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("lens,hk,hv,kd,vd", CASES, ids=[f"lens{c[0]}" for c in CASES])
def test_references_match_transformers(lens, hk, hv, kd, vd):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    inputs = make_inputs(lens, hk, hv, kd, vd)
    q, k, v, g, beta, cu, state, slots = inputs
    # transformers scales q itself (by K ** -0.5): hand it the unscaled q
    hf_args = (q * kd ** 0.5, k, v, g, beta, cu, state, slots)
    for ours, theirs in ((gated_delta_recurrent_ref, hf.torch_recurrent_gated_delta_rule),
                         (gated_delta_chunk_ref, hf.torch_chunk_gated_delta_rule)):
        expected_out, expected_state = per_sequence_oracle(theirs, *hf_args)
        pool = state.clone()
        out = ours(q, k, v, g, beta, cu, pool, slots)
        torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(pool[slots.long()], expected_state, atol=2e-5, rtol=2e-5)
        untouched = torch.ones(len(pool), dtype=torch.bool)
        untouched[slots.long()] = False
        assert torch.equal(pool[untouched], state[untouched]), "slots of other sequences were written"


def test_chunked_prefill_from_state_equals_one_pass():
    """Two calls (40 + 50 tokens) from the slot's state give the one-call result: the chunked
    rule resumes from whatever state a previous step left in the slot."""
    q, k, v, g, beta, _, state, _ = make_inputs([90], 2, 4, 16, 8)
    slots = torch.tensor([3], dtype=torch.int32)
    whole = state.clone()
    expected = gated_delta_chunk_ref(q, k, v, g, beta, torch.tensor([0, 90]), whole, slots)
    split = state.clone()
    first = gated_delta_chunk_ref(q[:40], k[:40], v[:40], g[:40], beta[:40], torch.tensor([0, 40]), split, slots)
    second = gated_delta_chunk_ref(q[40:], k[40:], v[40:], g[40:], beta[40:], torch.tensor([0, 50]), split, slots)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(split, whole, atol=2e-5, rtol=2e-5)


def _params(cases):
    return [pytest.param(*case, dtype, id=case_id(len(case[0]), sum(case[0]), case[2], case[3], dtype))
            for case, dtype in cases]


@pytest.mark.parametrize("lens,hk,hv,kd,vd,dtype", _params(RECURRENT_CASES))
def test_recurrent_kernel_matches_reference(lens, hk, hv, kd, vd, dtype):
    from shardserve.kernels.gated_delta_triton import gated_delta_recurrent_triton

    q, k, v, g, beta, cu, state, slots = make_inputs(lens, hk, hv, kd, vd, dtype)
    ref_pool, tri_pool = state.clone(), state.clone()
    expected = gated_delta_recurrent_ref(q, k, v, g, beta, cu, ref_pool, slots)
    actual = gated_delta_recurrent_triton(q, k, v, g, beta, cu, tri_pool, slots)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    # the state is float32 on both sides (inputs are upcast exactly): float32 tolerances
    assert_close(tri_pool, ref_pool, torch.float32, scale=2.0)


@pytest.mark.parametrize("lens,hk,hv,kd,vd,dtype", _params(CHUNK_CASES))
def test_chunk_kernel_matches_reference(lens, hk, hv, kd, vd, dtype):
    from shardserve.kernels.gated_delta_triton import gated_delta_chunk_triton

    q, k, v, g, beta, cu, state, slots = make_inputs(lens, hk, hv, kd, vd, dtype)
    ref_pool, tri_pool = state.clone(), state.clone()
    expected = gated_delta_chunk_ref(q, k, v, g, beta, cu, ref_pool, slots)
    actual = gated_delta_chunk_triton(q, k, v, g, beta, cu, tri_pool, slots)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype, scale=5.0 if dtype == torch.float32 else 1.0)
    assert_close(tri_pool, ref_pool, torch.float32, scale=5.0)
