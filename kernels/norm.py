"""RMSNorm with optional fused residual add (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.dispatch import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 scale_in_fp32: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 as HF does.

    Args:
        x: ``[num_tokens, hidden]`` any float dtype.
        weight: ``[hidden]``.
        residual: optional ``[num_tokens, hidden]``; when given, ``x + residual`` is normalized
            and also returned as the new residual.
        scale_in_fp32: the order of transformers' ``Qwen3NextRMSNorm`` / ``GemmaRMSNorm``: the
            float32 normalized rows times ``weight`` in float32, rounded once to ``x.dtype`` (give
            a float32 ``weight`` to keep ``1 + w`` exact). Default: ``LlamaRMSNorm``'s, the
            normalized rows rounded to ``x.dtype`` first, then times ``weight``.

    Returns:
        the normalized tensor (dtype ``promote(weight, x)``; ``x.dtype`` with ``scale_in_fp32``)
        or ``(normalized, new_residual)``.
    """
    if residual is not None:
        x = x + residual
        residual = x
    # torch's rms_norm is HF's float32 math (x * rsqrt(mean(x^2) + eps)) in one call: decode steps
    # are host-bound, every Python-level op counts.
    h = F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps)
    out = (h * weight.float()).to(x.dtype) if scale_in_fp32 else weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             scale_in_fp32: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatching RMSNorm: :func:`kernels.norm_triton.rms_norm_triton` when
    :func:`~kernels.dispatch.use_triton` says so, else :func:`rms_norm_ref` (same contract)."""
    if use_triton(x):
        from shardserve.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, scale_in_fp32)
    return rms_norm_ref(x, weight, eps, residual, scale_in_fp32)
