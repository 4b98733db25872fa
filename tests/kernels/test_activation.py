"""SiLU-and-mul: Triton kernel vs :func:`kernels.activation.silu_and_mul_ref`, and the reference vs the formula."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.activation import silu_and_mul_ref

SHAPES = [(1, 16), (9, 23), (4, 96)]  # (num_tokens, d): one token, odd d, a power-of-two-ish d


@pytest.mark.parametrize("num_tokens,dim,dtype",
                         [pytest.param(t, d, dt, id=case_id(1, t, 1, d, dt)) for t, d in SHAPES for dt in DTYPES])
def test_silu_and_mul_kernel_matches_reference(num_tokens, dim, dtype):
    from shardserve.kernels.activation_triton import silu_and_mul_triton

    x = 3 * torch.randn(num_tokens, 2 * dim, dtype=dtype)
    actual = silu_and_mul_triton(x)
    assert actual.shape == (num_tokens, dim) and actual.dtype == dtype
    assert_close(actual, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_kernel_3d_input():
    from shardserve.kernels.activation_triton import silu_and_mul_triton

    x = torch.randn(2, 3, 2 * 20)
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x), torch.float32)


def test_silu_and_mul_reference_matches_formula():
    x = torch.randn(5, 2 * 12, dtype=torch.float64)
    gate, up = x[:, :12], x[:, 12:]
    naive = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x), naive)
