"""RMSNorm module over :func:`kernels.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add; ``x [T, hidden]`` (HF ``LlamaRMSNorm``).

    ``dtype`` is the activations' (the model's compute dtype, :attr:`act_dtype`); the weight is
    ``weight_dtype`` when given (a float32 weight for norms that scale in float32), else ``dtype``.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.act_dtype = dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype or dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)
