"""Weight-only quantized linear layers on CPU: group-wise int4 and per-channel int8.

Both run torch's own CPU kernels with **low-precision activations** (bfloat16 in practice: with
float32 activations the same kernels take a slow path, 10-30x slower on this machine):

- int4: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (the "tinygemm" convention used by gpt-fast
  and torchao). A weight is ``w = (q - 8) * scale + zero`` for 4-bit codes ``q`` in 0..15, one
  ``(scale, zero)`` pair per output row and group of ``group_size`` input columns. GGUF's Q4_0
  (``w = d * (q - 8)``) is ``scale = d, zero = 0``; Q4_1 (``w = d * q + m``) is ``scale = d,
  zero = m + 8 d``.
- int8: ``torch.ops.aten._weight_int8pack_mm``: ``w = q * scale`` with int8 ``q`` and one scale per
  output row.

Each op sits beside its torch reference (``*_ref``: dequantize to float32, then a float32
matmul), the oracle of ``tests/kernels/test_packed_linear.py``. The packed int4 layout is the CPU
kernel's own (``_convert_weight_to_int4pack_for_cpu``), so these ops run on CPU tensors only; on
other devices weights are dequantized at load time instead.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)   # what _weight_int4pack_mm_for_cpu accepts


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the int4 CPU kernel takes a ``[out_features, in_features]`` weight: rows in multiples
    of 16 (its packing tile), whole groups of a size it knows along the input dim."""
    return (group_size in INT4_GROUP_SIZES and out_features % 16 == 0 and out_features > 0
            and in_features % group_size == 0 and in_features > 0)


def int8_supported(out_features: int, in_features: int) -> bool:
    """Whether the int8 CPU kernel takes the weight: the input dim a multiple of 16 (it reads
    16-wide vectors past the end otherwise; seen crashing on K = 8, 33 and 40)."""
    return out_features > 0 and in_features > 0 and in_features % 16 == 0


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack group-wise int4 weights for :func:`int4_linear`.

    Args:
        codes: ``[N, K]`` integer codes in 0..15.
        scales, zeros: ``[N, K // group_size]`` float (any precision; rounded to ``dtype``).
        dtype: activation dtype the kernel will run with (scales and zeros are stored in it).

    Returns:
        ``(packed [N, K // 2] uint8, scale_zeros [K // group_size, N, 2] dtype)``.

    Raises:
        ValueError: shapes the kernel does not take (see :func:`int4_supported`).
    """
    num_out, num_in = codes.shape
    group_size = num_in // scales.shape[1]
    if scales.shape != zeros.shape or scales.shape[0] != num_out or not int4_supported(num_out, num_in, group_size):
        raise ValueError(f"int4 pack: codes {list(codes.shape)}, scales {list(scales.shape)}, zeros "
                         f"{list(zeros.shape)}: need [N, K] codes with N % 16 == 0 and groups of {INT4_GROUP_SIZES}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
    return packed, scale_zeros


def int4_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` with ``W = (codes - 8) * scale + zero`` per group, all in float32.

    Args:
        x: ``[M, K]``. codes: ``[N, K]`` in 0..15. scales, zeros: ``[N, K // group_size]``.

    Returns:
        ``[M, N]`` float32.
    """
    num_out, num_in = codes.shape
    groups = scales.shape[1]
    weight = (codes.float() - 8).view(num_out, groups, -1) * scales.float()[..., None] + zeros.float()[..., None]
    return x.float() @ weight.view(num_out, num_in).t()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ W^T`` for a weight packed by :func:`pack_int4` (``_weight_int4pack_mm_for_cpu``).

    Args:
        x: ``[M, K]`` in the packing dtype (cast here when it is not). packed: ``[N, K // 2]`` uint8.
        scale_zeros: ``[K // group_size, N, 2]``. group_size: input columns per group.

    Returns:
        ``[M, N]`` in ``scale_zeros.dtype``.

    Raises:
        ValueError: a non-CPU tensor (the packed layout is the CPU kernel's).
    """
    if x.device.type != "cpu":
        raise ValueError(f"int4_linear runs on CPU tensors only, got {x.device}")
    return torch.ops.aten._weight_int4pack_mm_for_cpu(_as_input(x, scale_zeros.dtype), packed, group_size,
                                                      scale_zeros)


def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scales[:, None])^T`` in float32. ``x [M, K]``, ``qweight [N, K]`` int8,
    ``scales [N]``; returns ``[M, N]`` float32."""
    return x.float() @ (qweight.float() * scales.float()[:, None]).t()


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scales[:, None])^T`` through ``_weight_int8pack_mm``.

    Args:
        x: ``[M, K]`` (cast to ``scales.dtype``). qweight: ``[N, K]`` int8, ``K % 16 == 0``.
        scales: ``[N]`` in the activation dtype.

    Returns:
        ``[M, N]`` in ``scales.dtype``.

    Raises:
        ValueError: a non-CPU tensor.
    """
    if x.device.type != "cpu":
        raise ValueError(f"int8_linear runs on CPU tensors only, got {x.device}")
    return torch.ops.aten._weight_int8pack_mm(_as_input(x, scales.dtype), qweight, scales)


def _as_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` contiguous in ``dtype``; no op at all when it already is (the common case: two fewer
    dispatcher calls per matmul, 240 per SmolLM2 decode step)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()
