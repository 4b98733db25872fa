"""Triton SiLU-and-mul; the contract is :func:`kernels.activation.silu_and_mul_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable, pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK_D: tl.constexpr):
    # Grid (rows, cdiv(D, BLOCK_D)); gate is x[:, :D], up is x[:, D:].
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, gate * tl.sigmoid(gate) * up, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul, same contract as :func:`kernels.activation.silu_and_mul_ref`.

    Args:
        x: ``[..., 2 * d]`` float (math in float32, one rounding at the end).

    Returns:
        ``silu(x[..., :d]) * x[..., d:]`` of shape ``[..., d]`` in ``x.dtype``.
    """
    check_launchable(x)
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even"
    dim = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dim, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_d = min(pow2(dim), 1024)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(dim, block_d))](
            x2, out, x2.stride(0), out.stride(0), dim, BLOCK_D=block_d, num_warps=4)
    return out.view(*x.shape[:-1], dim)
