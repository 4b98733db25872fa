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

Both grow about linearly with the input rows ``M`` (``benchmarks/bench_packed_linear.py``), while a
dense bfloat16 GEMM (oneDNN, AMX tiles where the CPU has them) barely grows: from ~8-16 rows on an
AMX Xeon the dense matmul on a dequantized copy of the weight is 1.5-10x faster (prefill chunks,
verify steps, large decode batches). :func:`packed_matmul` therefore takes an optional dense copy and
a row threshold; :func:`dense_rows_auto` measures whether the copy pays on this CPU.

Each op sits beside its torch reference (``*_ref``: dequantize to float32, then a float32
matmul), the oracle of ``tests/kernels/test_packed_linear.py``. The packed int4 layout is the CPU
kernel's own (``_convert_weight_to_int4pack_for_cpu``), so these ops run on CPU tensors only; on
other devices weights are dequantized at load time instead.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from shardserve.kernels.ops import define_op

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


def packed_matmul(x: torch.Tensor, weights: list[torch.Tensor], kind: str, group_size: int,
                  dense_rows: int) -> torch.Tensor:
    """``x @ W^T`` for a packed weight, on its dense copy when ``x`` has at least ``dense_rows`` rows.

    Args:
        x: ``[M, K]``. weights: int4 ``[packed, scale_zeros]`` or int8 ``[qweight, scales]`` (the
            layouts above), then, when ``dense_rows > 0``, the dense ``[N, K]`` copy in the compute dtype.
        kind: ``"int4"`` or ``"int8"``. group_size: int4 input columns per group.
        dense_rows: smallest ``M`` that runs on the dense copy; 0 = always packed.

    Returns:
        ``[M, N]`` in the compute dtype.

    While Dynamo traces (``--compile``) with a dense copy this is one opaque op
    (``shardserve::packed_matmul``), so the row test is no guard on the symbolic token count (no
    recompilation at the threshold); without one the ATen kernel is traced as it is (Inductor calls
    it as an extern kernel: ~6 us less per matmul than through the custom op, 0.7 ms of a 6 ms
    SmolLM2 decode step).
    """
    if dense_rows and torch.compiler.is_compiling():
        return torch.ops.shardserve.packed_matmul(x, weights, kind, group_size, dense_rows)
    return _packed_matmul_eager(x, weights, kind, group_size, dense_rows)


def _packed_matmul_eager(x: torch.Tensor, weights: list[torch.Tensor], kind: str, group_size: int,
                         dense_rows: int) -> torch.Tensor:
    if dense_rows and x.shape[0] >= dense_rows:
        return F.linear(_as_input(x, weights[2].dtype), weights[2])
    if kind == "int4":
        return int4_linear(x, weights[0], weights[1], group_size)
    return int8_linear(x, weights[0], weights[1])


def _packed_matmul_fake(x: torch.Tensor, weights: list[torch.Tensor], kind: str, group_size: int,
                        dense_rows: int) -> torch.Tensor:
    num_out = weights[0].shape[0] if kind == "int8" else weights[1].shape[1]
    return x.new_empty((x.shape[0], num_out), dtype=weights[1].dtype)


define_op("packed_matmul(Tensor x, Tensor[] weights, str kind, int group_size, int dense_rows) -> Tensor",
          _packed_matmul_eager, _packed_matmul_fake)


DENSE_ROWS = 16   # the threshold dense_rows_auto gives where the dense copy pays


@functools.cache
def dense_rows_auto(dtype: torch.dtype) -> int:
    """:data:`DENSE_ROWS` when a dense ``dtype`` matmul of that many rows clearly beats (by 20 %)
    the packed int4 kernel on this CPU (with the process's torch threads), else 0 (keep no dense
    copies: CPUs without fast bfloat16 GEMMs, e.g. no AMX / AVX-512-BF16, where the copies would
    triple the weights' memory for nothing; and a float32 compute dtype, whose copies would undo
    what ``--quantization`` was asked to save). Measured once per process on a ``[2048, 1024]``
    weight, median of 7 calls each after 3 warm-up calls (~30 ms). On an AMX Xeon the dense matmul
    takes 0.37x the packed one at 16 rows but 0.75x at 8 (too close to call the same way every
    start), so the threshold is fixed at 16: runs on one machine take the same path for the same batch."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    num_out, num_in = 2048, 1024
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (num_out, num_in), generator=generator, dtype=torch.uint8)
    scales = torch.rand(num_out, num_in // 32, generator=generator) * 0.01
    packed, scale_zeros = pack_int4(codes, scales, torch.zeros_like(scales), dtype)
    dense = torch.randn(num_out, num_in, generator=generator).to(dtype)
    x = torch.randn(DENSE_ROWS, num_in, generator=generator).to(dtype)

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(7):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2] * 1e3

    packed_ms = median_ms(lambda: int4_linear(x, packed, scale_zeros, 32))
    dense_ms = median_ms(lambda: F.linear(x, dense))
    return DENSE_ROWS if dense_ms < 0.8 * packed_ms else 0
