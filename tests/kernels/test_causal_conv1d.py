"""Causal conv1d with window states: the reference vs transformers' Qwen3-Next conv functions
(prompt and cached decode), chunked equals one pass, and the Triton kernel vs the reference."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.causal_conv1d import causal_conv1d_ref


def make_inputs(lens, channels, width, dtype=torch.float32, num_slots=5):
    total = sum(lens)
    x = torch.randn(total, channels, dtype=dtype)
    weight = (torch.randn(channels, width) / width ** 0.5).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    state = torch.randn(num_slots, channels, width - 1, dtype=dtype)
    slots = torch.randperm(num_slots)[:len(lens)].to(torch.int32)
    return x, weight, cu, state, slots


def test_reference_matches_transformers():
    """A new sequence (zero window) is transformers' zero-padded prompt conv; the next tokens one
    at a time are its cached ``causal_conv1d_update``."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x, weight, _, _, _ = make_inputs([9], 12, 4)
    state = torch.zeros(2, 12, 3)
    slot = torch.tensor([1])
    out = causal_conv1d_ref(x[:6], weight, torch.tensor([0, 6]), state, slot)
    expected = hf.causal_conv1d_fn(x[None, :6].transpose(1, 2), weight, None, activation="silu")[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    hf_window = torch.nn.functional.pad(x[:6].transpose(0, 1), (4 - 6, 0))[None].clone()   # [1, C, W]: last 4 inputs
    for t in range(6, 9):
        ours = causal_conv1d_ref(x[t:t + 1], weight, torch.tensor([0, 1]), state, slot)
        theirs = hf.causal_conv1d_update(x[None, t:t + 1].transpose(1, 2), hf_window, weight, None, "silu")
        torch.testing.assert_close(ours, theirs[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state[1], x[6:9].transpose(0, 1))
    assert torch.equal(state[0], torch.zeros(12, 3)), "another slot was written"


def test_split_sequence_equals_one_pass():
    x, weight, _, state, _ = make_inputs([7], 10, 4)
    slot = torch.tensor([2])
    whole = state.clone()
    expected = causal_conv1d_ref(x, weight, torch.tensor([0, 7]), whole, slot)
    split = state.clone()
    parts = [causal_conv1d_ref(x[a:b], weight, torch.tensor([0, b - a]), split, slot) for a, b in ((0, 1), (1, 3), (3, 7))]
    torch.testing.assert_close(torch.cat(parts), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split, whole)


# (lengths, channels, width): decodes only (the batched path), a mix with sequences shorter than
# the window, odd channel counts over several channel blocks.
CASES = [([1, 1, 1], 40, 4), ([1, 2, 9, 3], 300, 4), ([5], 17, 3)]


@pytest.mark.parametrize("lens,channels,width,dtype", [
    pytest.param(lens, c, w, dt, id=case_id(len(lens), sum(lens), 1, c, dt, f"W{w}"))
    for lens, c, w in CASES for dt in DTYPES])
def test_kernel_matches_reference(lens, channels, width, dtype):
    from shardserve.kernels.causal_conv1d_triton import causal_conv1d_triton

    x, weight, cu, state, slots = make_inputs(lens, channels, width, dtype)
    ref_state, tri_state = state.clone(), state.clone()
    expected = causal_conv1d_ref(x, weight, cu, ref_state, slots)
    actual = causal_conv1d_triton(x, weight, cu, tri_state, slots)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)
    assert torch.equal(tri_state, ref_state), "window states are copies of inputs: exact"
