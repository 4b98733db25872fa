"""Triton fast Walsh-Hadamard transform; contract :func:`kernels.hadamard.hadamard_transform_ref`.

Each program transforms BLOCK_M rows held in registers with log2(n) butterfly stages
(n log n adds instead of the reference's n^2 multiply-adds). Stage s views a row as
``[n / 2c, 2, c]`` with ``c = 2**s``: the pair ``(u, v)`` at distance c becomes
``(u + v, u - v)``, which is Sylvester's ``H_2c = [[H_c, H_c], [H_c, -H_c]]`` recursion.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, num_rows, stride_x, stride_o, scale,
                     N: tl.constexpr, LOG_N: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, N)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    first = (tl.arange(0, 2) == 0)[None, None, :, None]           # [1, 1, 2, 1]: u slot vs v slot
    sign = tl.where(first, 1.0, -1.0)
    for stage in tl.static_range(LOG_N):
        # shape [rows, n / 2c, 2, c], c = 2**stage, written inline: a local `c = 1 << stage` is a
        # tensor to the compiler (a shape needs constexpr ints; annotating it constexpr is refused
        # as a reassignment across the unrolled stages)
        pairs = tl.reshape(x, [BLOCK_M, N >> (stage + 1), 2, 1 << stage])
        total = tl.sum(pairs, axis=2)                                # u + v   [BLOCK_M, N / 2c, c]
        diff = tl.sum(pairs * sign, axis=2)                          # u - v
        pairs = tl.where(first, total[:, :, None, :], diff[:, :, None, :])
        x = tl.reshape(pairs, [BLOCK_M, N])
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], x * scale, mask=mask)


def hadamard_transform_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`kernels.hadamard.hadamard_transform_ref` (orthonormal, float32 math).

    Args:
        x: ``[..., n]`` float with ``n`` a power of two in ``[2, 1024]`` (64..256 tested);
            rows may be strided, the last dim must be contiguous.

    Returns:
        a new contiguous tensor of ``x``'s shape and dtype.
    """
    check_launchable(x)
    dim = x.shape[-1]
    assert 2 <= dim <= 1024 and dim & (dim - 1) == 0, f"Hadamard dim must be a power of two in [2, 1024], got {dim}"
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0]
    if num_rows:
        block_m = max(1, min(16, 2048 // dim))
        _hadamard_kernel[(triton.cdiv(num_rows, block_m),)](
            rows, out, num_rows, rows.stride(0), out.stride(0), dim ** -0.5,
            N=dim, LOG_N=int(math.log2(dim)), BLOCK_M=block_m, num_warps=4)
    return out.view(x.shape)
