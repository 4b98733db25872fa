"""Rotary position embedding (Su et al. 2021), half-split (NeoX / HF ``rotate_half``) or
interleaved (GPT-J / DeepSeek MLA) layout."""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token factors :func:`rotate` multiplies by, in ``dtype``: they depend only on the
    positions, so a model computes them once per step and shares them across its layers.

    Args:
        cos, sin: ``[num_tokens, rot_dim // 2]`` float32 (one angle per pair).
        dtype: dtype of the tensors to rotate (HF does the math in it).

    Returns:
        ``(cos, sin)``, each ``[num_tokens, 1, rot_dim // 2]`` (interleaved) or
        ``[num_tokens, 1, rot_dim]`` (half-split: each half repeated, HF ``emb = cat(freqs, freqs)``;
        sin's first half negated, the sign of HF's ``rotate_half``).
    """
    cos = cos[:, None, :].to(dtype)
    sin = sin[:, None, :].to(dtype)
    if interleaved:
        return cos, sin
    # The half-split sin carries rotate_half's sign: rotate_half(x) * sin == x.roll(half) * [-sin, sin].
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the last dim of ``x [num_tokens, num_heads, rot_dim]`` by factors from
    :func:`rotary_factors`; returns a new tensor of ``x``'s shape and dtype."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    # HF's x * cos + rotate_half(x) * sin in four ops, rounding as it does: (-x2) * s == x2 * (-s).
    out = x * cos
    return out.add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin))


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the last dim of ``x`` by per-token angles.

    Args:
        x: ``[num_tokens, num_heads, rot_dim]``.
        cos, sin: ``[num_tokens, rot_dim // 2]`` float32 (one angle per pair).
        interleaved: pairs are ``(x[2i], x[2i+1])`` when True, ``(x[i], x[i + rot_dim/2])`` when False.

    Returns:
        a new tensor of ``x``'s shape and dtype (math in ``x``'s dtype as HF does).
    """
    return rotate(x, *rotary_factors(cos, sin, x.dtype, interleaved), interleaved)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Dispatching RoPE: :func:`kernels.rotary_triton.apply_rotary_triton` when
    :func:`~kernels.dispatch.use_triton` says so, else :func:`apply_rotary_ref` (same contract)."""
    if use_triton(x):
        from shardserve.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(x, cos, sin, interleaved)
    return apply_rotary_ref(x, cos, sin, interleaved)
