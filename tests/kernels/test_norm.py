"""RMSNorm: Triton kernel vs :func:`kernels.norm.rms_norm_ref`, and the reference vs the formula."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.norm import rms_norm_ref

# (num_tokens, hidden): one token, odd hidden (masked tail), a power of two.
SHAPES = [(1, 64), (7, 33), (5, 128)]
CASES = [pytest.param(t, d, dt, res, id=case_id(1, t, 1, d, dt, "residual" if res else "plain"))
         for t, d in SHAPES for dt in DTYPES for res in (False, True)]


@pytest.mark.parametrize("num_tokens,hidden,dtype,with_residual", CASES)
def test_rms_norm_kernel_matches_reference(num_tokens, hidden, dtype, with_residual):
    from shardserve.kernels.norm_triton import rms_norm_triton

    x = torch.randn(num_tokens, hidden, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(num_tokens, hidden, dtype=dtype) if with_residual else None
    x_before = x.clone()
    expected = rms_norm_ref(x, weight, 1e-6, residual)
    actual = rms_norm_triton(x, weight, 1e-6, residual)
    assert torch.equal(x, x_before), "inputs must not be mutated"
    if with_residual:
        assert_close(actual[0], expected[0], dtype)
        assert_close(actual[1], expected[1], dtype)  # x + residual: one rounding, identical
        assert actual[0].dtype == expected[0].dtype
    else:
        assert_close(actual, expected, dtype)
        assert actual.dtype == expected.dtype


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_scale_in_fp32_rounds_once(with_residual):
    """Qwen3-Next's order (``Qwen3NextRMSNorm``): a float32 ``1 + w`` times the float32 normalized
    rows, one rounding to bf16. The reference is that formula exactly, the kernel within a few bf16
    ulps of it (Triton's interpreter truncates where a GPU rounds to nearest, in the residual sum
    too), and the Llama order (rows rounded first) differs from it."""
    from shardserve.kernels.norm_triton import rms_norm_triton

    x = torch.randn(7, 96, dtype=torch.bfloat16)
    weight = 1 + 0.02 * torch.randn(96)
    residual = torch.randn(7, 96, dtype=torch.bfloat16) if with_residual else None
    summed = (x + residual).float() if with_residual else x.float()
    exact = (weight * summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def normed(out):
        return out[0] if with_residual else out

    ref = normed(rms_norm_ref(x, weight, 1e-6, residual, scale_in_fp32=True))
    assert ref.dtype == torch.bfloat16 and torch.equal(ref, exact)
    kernel = normed(rms_norm_triton(x, weight, 1e-6, residual, scale_in_fp32=True))
    assert kernel.dtype == torch.bfloat16
    assert ((kernel.float() - exact.float()).abs() <= 2 ** -5 * exact.float().abs()).all()
    assert not torch.equal(normed(rms_norm_ref(x, weight, 1e-6, residual)).to(torch.bfloat16), exact)


def test_rms_norm_kernel_strided_rows():
    """A row slice of a wider tensor (MLA's kv_a_layernorm input) is read in place."""
    from shardserve.kernels.norm_triton import rms_norm_triton

    wide = torch.randn(6, 80)
    x = wide[:, :48]
    weight = torch.randn(48)
    assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), torch.float32)


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_reference_matches_formula(with_residual):
    x = torch.randn(4, 40, dtype=torch.float64)
    residual = torch.randn(4, 40, dtype=torch.float64) if with_residual else None
    weight = torch.randn(40, dtype=torch.float64)
    summed = x + residual if with_residual else x
    naive = torch.stack([weight * row / (row.square().sum() / row.numel() + 1e-6).sqrt() for row in summed])
    out = rms_norm_ref(x.float(), weight.float(), 1e-6, None if residual is None else residual.float())
    normed = out[0] if with_residual else out
    torch.testing.assert_close(normed.double(), naive, atol=1e-5, rtol=1e-5)
    if with_residual:
        torch.testing.assert_close(out[1].double(), summed, atol=1e-6, rtol=1e-6)
