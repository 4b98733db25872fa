"""Triton RMSNorm with fused residual add; the contract is :func:`kernels.norm.rms_norm_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton_utils import check_launchable, pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    D, eps,
    HAS_RESIDUAL: tl.constexpr, SCALE_IN_FP32: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per row of length D.
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to x's dtype first, as the reference's ``x + residual`` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / D + eps)
    normed = h * inv_rms
    if not SCALE_IN_FP32:
        normed = normed.to(x.dtype).to(tl.float32)  # LlamaRMSNorm casts back before the weight multiply
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, w * normed, mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    scale_in_fp32: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm, same contract as :func:`kernels.norm.rms_norm_ref`.

    Args:
        x: ``[..., hidden]`` float; rows may be strided (a slice of a wider tensor).
        weight: ``[hidden]``.
        eps: variance epsilon.
        residual: optional ``[..., hidden]`` of ``x``'s dtype, added before the norm.
        scale_in_fp32: the weight multiplies the unrounded float32 rows; ``out`` is ``x.dtype``.

    Returns:
        ``out`` of dtype ``promote(weight, x)`` (``x.dtype`` with ``scale_in_fp32``), or
        ``(out, x + residual)``; inputs are not mutated.
    """
    check_launchable(x, weight)
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} vs hidden {hidden}"
    x2 = x.reshape(-1, hidden) if x.stride(-1) == 1 else x.contiguous().view(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if scale_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_in = res_out = x2  # placeholders, unused without a residual
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, \
            f"residual {tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}"
        res_in = residual.reshape(-1, hidden).contiguous()
        res_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    num_rows = x2.shape[0]
    if num_rows:
        block_d = pow2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x2, res_in, weight, out, res_out,
            x2.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, SCALE_IN_FP32=scale_in_fp32, BLOCK_D=block_d, num_warps=min(max(block_d // 256, 1), 16))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
