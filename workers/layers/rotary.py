"""RoPE angle tables, computed exactly as transformers computes them (``modeling_rope_utils``)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Holds ``cos``/``sin`` of every position up to ``max_positions`` and rotates q/k in place of HF.

    Args:
        config: a transformers config with ``rope_parameters`` (``rope_theta``, ``rope_type``).
        rot_dim: rotated dims per head.
        max_positions: table length.
        interleaved: pair layout (see :func:`kernels.rotary.apply_rotary_ref`).

    The table is ``[max_positions, rot_dim // 2]`` float32; ``attention_scaling`` (YaRN's mscale on
    cos/sin, 1.0 for default RoPE) is folded in. It is computed on the CPU (the values do not depend
    on where the model runs) and moved with the model. Built under the ``meta`` device (the
    meta-device build of ``workers/weight_loader.py``), the table is only a shape until
    :meth:`init_buffers` computes it where the model is materialized.
    """

    def __init__(self, config, rot_dim: int, max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        self.config, self.rot_dim, self.max_positions = config, rot_dim, max_positions
        if torch.get_default_device().type == "meta":
            shape = (max_positions, rot_dim // 2)
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin", torch.empty(shape), persistent=False)
        else:
            self.init_buffers(torch.get_default_device())
        self.interleaved = interleaved
        self._angles: tuple[torch.Tensor, ...] = ()   # (positions, cos, sin) of the last call
        self._factors: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}   # rotary_factors of _angles

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the ``cos`` / ``sin`` tables (on the CPU, as transformers does) and keep them on ``device``."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config, rot_dim = self.config, self.rot_dim
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
        rope_type = params.get("rope_type", "default")
        with torch.device("cpu"):   # NOTE: overrides a "cuda" default device of the caller
            if rope_type == "default":
                base = params["rope_theta"]
                inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
                scaling = 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            freqs = torch.arange(self.max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", (freqs.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each ``x [T, heads, rot_dim]`` by the angles of ``positions [T]``."""
        from shardserve.kernels import apply_rotary, use_triton
        from shardserve.kernels.rotary import rotary_factors, rotate

        if torch.compiler.is_compiling():   # no per-step memo in a graph: Inductor shares the work itself
            cos, sin = self.cos[positions], self.sin[positions]
            return tuple(rotate(x, *rotary_factors(cos, sin, x.dtype, self.interleaved), self.interleaved) for x in xs)
        if not self._angles or self._angles[0] is not positions:   # once per step, not once per layer
            self._angles = (positions, self.cos[positions], self.sin[positions])
            self._factors = {}
        _, cos, sin = self._angles
        out = []
        for x in xs:
            if use_triton(x):
                out.append(apply_rotary(x, cos, sin, self.interleaved))
                continue
            factors = self._factors.get(x.dtype)   # the torch path's casts and concatenations, once per step
            if factors is None:
                factors = self._factors[x.dtype] = rotary_factors(cos, sin, x.dtype, self.interleaved)
            out.append(rotate(x, *factors, self.interleaved))
        return tuple(out)
