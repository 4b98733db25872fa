"""Walsh-Hadamard: Triton butterfly vs the dense reference, the reference vs the bit-parity definition."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.hadamard import hadamard_transform_ref, sylvester_matrix


@pytest.mark.parametrize("num_tokens,num_heads,dim,dtype", [
    pytest.param(t, h, d, dt, id=case_id(1, t, h, d, dt)) for t, h, d in [(1, 1, 64), (7, 1, 128), (3, 3, 256)]
    for dt in DTYPES])
def test_hadamard_kernel_matches_reference(num_tokens, num_heads, dim, dtype):
    from shardserve.kernels.hadamard_triton import hadamard_transform_triton

    x = torch.randn(num_tokens, num_heads, dim, dtype=dtype)
    actual = hadamard_transform_triton(x)
    assert actual.shape == x.shape and actual.dtype == dtype
    assert_close(actual, hadamard_transform_ref(x), dtype)


def test_hadamard_kernel_strided_rows():
    from shardserve.kernels.hadamard_triton import hadamard_transform_triton

    wide = torch.randn(5, 200)
    x = wide[:, 8:72]                                  # 64 columns, row stride 200
    assert_close(hadamard_transform_triton(x), hadamard_transform_ref(x), torch.float32)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_hadamard_reference_matches_bit_parity_definition(dim):
    """H[i, j] = (-1) ** popcount(i & j) / sqrt(n), built entry by entry, in float64."""
    idx = torch.arange(dim)
    anded = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(anded)
    for bit in range(dim.bit_length()):
        parity ^= (anded >> bit) & 1
    signs = (1 - 2 * parity).double()
    assert torch.equal(sylvester_matrix(dim).double(), signs)
    dense = signs / dim ** 0.5
    x = torch.randn(4, dim, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform_ref(x.float()).double(), x @ dense.T, atol=1e-5, rtol=1e-5)


def test_hadamard_is_orthonormal():
    q, k = torch.randn(6, 128), torch.randn(6, 128)
    hq, hk = hadamard_transform_ref(q), hadamard_transform_ref(k)
    torch.testing.assert_close((hq * hk).sum(-1), (q * k).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(hadamard_transform_ref(hq), q, atol=1e-5, rtol=1e-5)


def test_sylvester_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        sylvester_matrix(96)
