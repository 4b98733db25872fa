"""SiLU-and-mul for SwiGLU MLPs (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[num_tokens, 2 * d]``; returns ``[num_tokens, d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatching SiLU-and-mul: :func:`kernels.activation_triton.silu_and_mul_triton` when
    :func:`~kernels.dispatch.use_triton` says so, else :func:`silu_and_mul_ref` (same contract)."""
    if use_triton(x):
        from shardserve.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
