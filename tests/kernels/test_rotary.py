"""RoPE: Triton kernel vs :func:`kernels.rotary.apply_rotary_ref`, and the reference vs complex rotation."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id
from shardserve.kernels.rotary import apply_rotary_ref

SHAPES = [(1, 1, 16), (5, 3, 24), (4, 4, 64)]  # (num_tokens, num_heads, rot_dim); 24 -> half 12 (masked)


def angles(positions: torch.Tensor, rot_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, rot_dim // 2]`` float32 of ``positions``, as workers' RotaryEmbedding builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("num_tokens,num_heads,rot_dim,dtype,interleaved", [
    pytest.param(t, h, d, dt, il, id=case_id(1, t, h, d, dt, "interleaved" if il else "half"))
    for t, h, d in SHAPES for dt in DTYPES for il in (False, True)])
def test_rotary_kernel_matches_reference(num_tokens, num_heads, rot_dim, dtype, interleaved):
    from shardserve.kernels.rotary_triton import apply_rotary_triton

    x = torch.randn(num_tokens, num_heads, rot_dim, dtype=dtype)
    cos, sin = angles(torch.randint(0, 4096, (num_tokens,)), rot_dim)
    actual = apply_rotary_triton(x, cos, sin, interleaved)
    assert actual.dtype == dtype
    assert_close(actual, apply_rotary_ref(x, cos, sin, interleaved), dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_kernel_strided_slice(interleaved):
    """The rope part of q (``q[..., nope:]``, a strided view) is read in place."""
    from shardserve.kernels.rotary_triton import apply_rotary_triton

    q = torch.randn(3, 2, 48)
    x = q[..., 16:]
    cos, sin = angles(torch.tensor([0, 7, 300]), 32)
    assert_close(apply_rotary_triton(x, cos, sin, interleaved), apply_rotary_ref(x, cos, sin, interleaved),
                 torch.float32)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rotary_reference_matches_complex_rotation(interleaved):
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    positions = torch.arange(6)
    cos, sin = angles(positions, 16)
    theta = torch.atan2(sin.double(), cos.double())                    # [T, 8]
    if interleaved:
        pairs = torch.view_as_complex(x.view(6, 2, 8, 2).contiguous())
    else:
        pairs = torch.complex(x[..., :8], x[..., 8:])
    rotated = pairs * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    if interleaved:
        naive = torch.view_as_real(rotated).flatten(-2)
    else:
        naive = torch.cat([rotated.real, rotated.imag], dim=-1)
    out = apply_rotary_ref(x.float(), cos, sin, interleaved)
    torch.testing.assert_close(out.double(), naive, atol=1e-5, rtol=1e-5)
