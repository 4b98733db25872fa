"""Orthonormal Walsh-Hadamard transform along the last dim (DSA indexer q/k rotation).

``H_n`` is the Sylvester matrix (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``) scaled by
``n ** -0.5``, so it is symmetric and orthonormal: ``(H q) . (H k) == q . k`` and ``H (H x) == x``.
DeepSeek-V3.2 rotates indexer queries and keys with it before fp8 quantization.
"""

from __future__ import annotations

import functools

import torch

from shardserve.kernels.dispatch import use_triton


@functools.lru_cache(maxsize=16)
def _sylvester(dim: int, device: torch.device) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float32, device=device)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def sylvester_matrix(dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The unnormalized ``[dim, dim]`` float32 Sylvester-Hadamard matrix of ``+-1`` (cached).

    Raises:
        ValueError: ``dim`` is not a power of two.
    """
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard dim must be a power of two, got {dim}")
    return _sylvester(dim, torch.device(device or "cpu"))


def hadamard_transform_ref(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_n * n ** -0.5`` along the last dim, by dense matmul in float32.

    Args:
        x: ``[..., n]`` float, ``n`` a power of two (64..256 in DeepSeek-V3.2; any works here).

    Returns:
        a tensor of ``x``'s shape and dtype.
    """
    dim = x.shape[-1]
    matrix = sylvester_matrix(dim, x.device)
    return (x.float() @ matrix * dim ** -0.5).to(x.dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Dispatching Hadamard transform (:func:`kernels.hadamard_triton.hadamard_transform_triton`,
    an O(n log n) butterfly, or :func:`hadamard_transform_ref`; same contract)."""
    if use_triton(x):
        from shardserve.kernels.hadamard_triton import hadamard_transform_triton

        return hadamard_transform_triton(x)
    return hadamard_transform_ref(x)
