"""Causal depthwise conv1d with a per-sequence window state (Qwen3-Next / Mamba short convolution).

Channel ``c`` of token ``t``: ``out[t, c] = act(sum_j weight[c, j] * x[t - (W-1) + j, c])`` over the
``W`` latest inputs, where inputs before the sequence's first token in this call come from its
window state (the ``W - 1`` inputs before it, zero for a new sequence). The state is then set to
the last ``W - 1`` inputs, so the next step (decode, or the next prefill chunk) continues
seamlessly. transformers' ``causal_conv1d_fn`` / ``causal_conv1d_update`` in
``models/qwen3_next/modeling_qwen3_next.py`` compute the same (zero-padded conv for a prompt, the
cached window for decode); the activation is SiLU.

Layout: packed tokens ``x [T, C]`` of ``B`` sequences (``cu_seqlens [B + 1]``), ``weight [C, W]``
(the checkpoint's ``conv1d.weight [C, 1, W]`` squeezed), window states ``[num_slots, C, W - 1]``
read and written at ``slots [B]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.dispatch import use_triton


def _check(x, weight, cu_seqlens, conv_state, slots) -> None:
    channels, width = weight.shape
    assert x.dim() == 2 and x.shape[1] == channels, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert conv_state.shape[1:] == (channels, width - 1), \
        f"conv_state {tuple(conv_state.shape)} vs [slots, {channels}, {width - 1}]"
    assert cu_seqlens.shape == (slots.shape[0] + 1,), f"cu_seqlens {tuple(cu_seqlens.shape)} vs {slots.shape[0]} slots"


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                      slots: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """Reference: per sequence, ``F.conv1d`` over ``[window state, inputs]`` (one-token steps,
    the decode case, as one batched dot product).

    Args:
        x: ``[T, C]``. weight: ``[C, W]``. cu_seqlens: ``[B + 1]`` int (every sequence has at
            least one token).
        conv_state: ``[num_slots, C, W - 1]`` in ``x``'s dtype, updated in place at ``slots``.
        slots: ``[B]`` int, each sequence's slot (distinct).
        silu: apply SiLU to the output.

    Returns:
        ``[T, C]`` in ``x.dtype``.
    """
    _check(x, weight, cu_seqlens, conv_state, slots)
    width = weight.shape[1]
    slots = slots.long()
    if x.shape[0] == slots.shape[0]:   # one token per sequence
        window = torch.cat((conv_state[slots], x[:, :, None]), dim=-1)                # [B, C, W]
        out = (window * weight[None]).sum(-1)
        conv_state[slots] = window[:, :, 1:]
    else:
        out = torch.empty_like(x)
        bounds = cu_seqlens.tolist()
        for b, slot in enumerate(slots.tolist()):
            rows = slice(bounds[b], bounds[b + 1])
            window = torch.cat((conv_state[slot], x[rows].transpose(0, 1)), dim=-1)   # [C, W - 1 + L]
            out[rows] = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0].transpose(0, 1)
            conv_state[slot] = window[:, window.shape[1] - (width - 1):]
    return F.silu(out) if silu else out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                  slots: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """Dispatching conv (:func:`kernels.causal_conv1d_triton.causal_conv1d_triton` or
    :func:`causal_conv1d_ref`, same contract)."""
    if use_triton(x):
        from shardserve.kernels.causal_conv1d_triton import causal_conv1d_triton

        return causal_conv1d_triton(x, weight, cu_seqlens, conv_state, slots, silu)
    return causal_conv1d_ref(x, weight, cu_seqlens, conv_state, slots, silu)
