"""SiLU-and-mul for SwiGLU MLPs (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[num_tokens, 2 * d]``; returns ``[num_tokens, d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatching SiLU-and-mul; see :func:`silu_and_mul_ref`."""
    return silu_and_mul_ref(x)
