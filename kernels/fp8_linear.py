"""Linear layer with an FP8 block-scaled weight (DeepSeek-V3 format) kept in FP8.

``W[n, k] = weight[n, k] * scale_inv[n // bo, k // bi]`` (``float8_e4m3fn`` values, one float32
scale per ``bo x bi`` block; DeepSeek-V3 ``inference/kernel.py: weight_dequant``). On GPU the Triton
kernel multiplies activations by the FP8 tiles directly (W8A16: the tiles are widened in registers
and each tile's partial product is scaled once), so the weight stays 1 byte per element in memory
and is read once per step. The torch reference dequantizes the whole weight first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.dispatch import use_triton


def dequantize_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """``[N, K]`` float32 weight from ``float8_e4m3fn`` ``weight [N, K]`` and ``scale_inv
    [ceil(N / bo), ceil(K / bi)]`` (float32)."""
    block_rows, block_cols = block_size
    rows, cols = weight.shape
    expanded = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return weight.float() * expanded


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``W`` dequantized in float32 and rounded to ``x.dtype`` (the numbers
    a load-time dequantization to ``x.dtype`` gives).

    Args:
        x: ``[T, K]`` bf16/fp16/fp32 activations.
        weight: ``[N, K]`` float8_e4m3fn.
        scale_inv: ``[ceil(N / bo), ceil(K / bi)]`` float32.
        block_size: ``(bo, bi)``.
        bias: optional ``[N]``.

    Returns:
        ``[T, N]`` in ``x.dtype``.
    """
    return F.linear(x, dequantize_fp8_weight(weight, scale_inv, block_size).to(x.dtype), bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatching FP8 block-scaled linear (:func:`kernels.fp8_linear_triton.fp8_block_linear_triton`
    or :func:`fp8_block_linear_ref`, same contract)."""
    if use_triton(x):
        from shardserve.kernels.fp8_linear_triton import fp8_block_linear_triton

        return fp8_block_linear_triton(x, weight, scale_inv, block_size, bias)
    return fp8_block_linear_ref(x, weight, scale_inv, block_size, bias)
