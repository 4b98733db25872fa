"""Triton W8A16 GEMM for FP8 block-scaled weights. Contract: :mod:`kernels.fp8_linear` reference.

One program per ``BLOCK_M x BLOCK_N`` output tile walks K in ``BLOCK_K`` steps; ``BLOCK_K``
divides the scale block's width, so a K step lies in one scale column and its partial product is
scaled by one float32 per output column (``scale_inv[n // bo, k // bi]``) before accumulating.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable, interpreting, mma, pow2


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)                    # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)                    # [BLOCK_K, BLOCK_N] fp8
        scale = tl.load(s_ptr + (offs_n // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS, mask=n_mask, other=0.0)
        acc += mma(a, w.to(a.dtype), UPCAST) * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`kernels.fp8_linear.fp8_block_linear_ref`.

    Args:
        x: ``[T, K]`` activations (any leading dims are flattened).
        weight: ``[N, K]`` float8_e4m3fn, K contiguous.
        scale_inv: ``[ceil(N / bo), ceil(K / bi)]`` float32.
        block_size: ``(bo, bi)``; ``bi`` must be a multiple of 16.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype`` (accumulated in float32).
    """
    check_launchable(x, weight, scale_inv)
    block_rows, block_cols = block_size
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    num_rows, in_features = x2.shape
    out_features = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape[1] == in_features and weight.stride(-1) == 1, \
        f"weight {weight.dtype} {tuple(weight.shape)} vs x {tuple(x.shape)}"
    assert scale_inv.shape == (triton.cdiv(out_features, block_rows), triton.cdiv(in_features, block_cols)), \
        f"scale_inv {tuple(scale_inv.shape)} for weight {tuple(weight.shape)} and blocks {block_size}"
    assert block_cols % 16 == 0, f"scale block width {block_cols} must be a multiple of 16"
    scale_inv = scale_inv.float().contiguous()
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.view(*lead, out_features)
    block_k = min(block_cols, 128)
    while block_cols % block_k:
        block_k //= 2
    block_m = min(pow2(num_rows, 16), 64)
    block_n = 64
    _fp8_linear_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))](
        x2, weight, scale_inv, bias if bias is not None else scale_inv, out, num_rows, out_features, in_features,
        x2.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        SCALE_ROWS=block_rows, SCALE_COLS=block_cols, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=interpreting(), num_warps=4)
    return out.view(*lead, out_features)
