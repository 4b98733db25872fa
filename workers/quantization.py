"""Weight-only quantized weights on CPU: which weights stay quantized, and their integer form.

A :class:`QuantizedWeight` is a weight as the packed CPU kernels (``kernels/packed_linear.py``)
take it, before packing: 4-bit codes with one ``(scale, zero)`` per row and group of 32 input
columns (``w = (q - 8) * scale + zero``), or int8 codes with one scale per row (``w = q * scale``).
It comes from a GGUF file (:func:`decode_gguf`, no float round trip for Q4_0 / Q4_1) or from a
float weight (:func:`quantize_int4` / :func:`quantize_int8`, ``--quantization``).

GGUF block formats (ggml ``ggml-common.h``; ``gguf`` package ``quants.py``), 32 weights per block:

- Q4_0, 18 bytes: fp16 ``d``, 16 bytes of nibbles; byte ``j`` holds weight ``j`` (low nibble) and
  weight ``j + 16`` (high). ``w = d * (q - 8)``: scale ``d``, zero 0.
- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, nibbles as Q4_0. ``w = d * q + m = (q - 8) * d + (m + 8 d)``:
  scale ``d``, zero ``m + 8 d``.
- Q8_0, 34 bytes: fp16 ``d``, 32 int8 ``q``. ``w = d * q`` with one ``d`` per 32 weights; the int8
  kernel (``_weight_int8pack_mm``) has one scale per output row, so the weights are re-rounded to
  ``s = max|w_row| / 127`` (error at most ``s / 2`` per weight; 1.2 % relative RMS on
  SmolLM2's embedding), from the whole row, so every tensor-parallel slice holds the same values.

The rule for ``--dtype auto`` on CPU is :func:`workers.device.resolve_dtype`: bfloat16 compute with
packed weights when most of a GGUF file's matrix weights are Q4_0 / Q4_1 / Q8_0, float32 otherwise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from shardserve.kernels.packed_linear import dense_rows_auto

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
PACKED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(slots=True)
class QuantizedWeight:
    """An ``[N, K]`` weight in integer form.

    Attributes:
        kind: ``"int4"`` (group-wise, asymmetric) or ``"int8"`` (per-row, symmetric).
        codes: ``[N, K]`` uint8 in 0..15 (int4) or int8 (int8).
        scales: ``[N, K // group_size]`` float32 (int4) or ``[N]`` float32 (int8).
        zeros: ``[N, K // group_size]`` float32 (int4); None for int8.
        group_size: input columns per group (int4).
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    group_size: int = GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, start: int, size: int) -> QuantizedWeight:
        """Output rows ``[start, start + size)`` (column-parallel slice, vocab slice)."""
        zeros = None if self.zeros is None else self.zeros[start:start + size]
        return QuantizedWeight(self.kind, self.codes[start:start + size], self.scales[start:start + size], zeros,
                               self.group_size)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Output rows in the order of ``index [N']`` int64 (llama.cpp's Q/K row permutation undone)."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedWeight(self.kind, self.codes[index], self.scales[index], zeros, self.group_size)

    def cols(self, start: int, size: int) -> QuantizedWeight | None:
        """Input columns ``[start, start + size)`` (row-parallel slice), or None when the slice
        would cut an int4 group (the caller then falls back to the dequantized weight)."""
        if self.kind == "int8":
            return QuantizedWeight("int8", self.codes[:, start:start + size], self.scales)
        if start % self.group_size or size % self.group_size:
            return None
        groups = slice(start // self.group_size, (start + size) // self.group_size)
        return QuantizedWeight("int4", self.codes[:, start:start + size], self.scales[:, groups],
                               self.zeros[:, groups], self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight these codes stand for."""
        if self.kind == "int8":
            return self.codes.float() * self.scales[:, None]
        num_out, num_in = self.codes.shape
        grouped = (self.codes.float() - 8).view(num_out, -1, self.group_size)
        return (grouped * self.scales[..., None] + self.zeros[..., None]).view(num_out, num_in)

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """Stack along output rows (packed QKV, gate/up), or None when the parts differ in kind."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
            return None
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return QuantizedWeight(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               zeros, first.group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> QuantizedWeight:
    """Round-to-nearest asymmetric int4 per group: ``scale = (max - min) / 15``, ``zero`` such that
    code 0 is the group's minimum (``zero = min + 8 * scale``). ``weight [N, K]``, ``K % group_size == 0``."""
    num_out, num_in = weight.shape
    grouped = weight.float().view(num_out, num_in // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-10)
    codes = ((grouped - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", codes.view(num_out, num_in), scales, low + 8 * scales, group_size)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Round-to-nearest symmetric int8 per output row: ``scale = max|w_row| / 127``. ``weight [N, K]``."""
    scales = (weight.float().abs().amax(-1) / 127).clamp(min=1e-10)
    codes = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes, scales)


def decode_gguf(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantizedWeight:
    """Integer form of a Q4_0 / Q4_1 / Q8_0 GGUF tensor (formats in the module docstring).

    Args:
        data: the tensor's raw blocks, ``[N, K // 32 * block_bytes]`` uint8 (``GGUFReader`` layout).
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        shape: torch shape ``(N, K)``.

    Raises:
        ValueError: another type, or data whose size does not match ``shape``.
    """
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"no integer form for GGUF type {qtype}")
    num_out, num_in = shape
    blocks = np.asarray(data).reshape(num_out, num_in // GROUP_SIZE, _BLOCK_BYTES[qtype])
    d = blocks[..., :2].view(np.float16)[..., 0].astype(np.float32)                          # [N, G]
    if qtype == "Q8_0":
        values = torch.from_numpy(blocks[..., 2:].view(np.int8).astype(np.float32) * d[..., None])
        return quantize_int8(values.view(num_out, num_in))
    nibbles = blocks[..., 4 if qtype == "Q4_1" else 2:]                                       # [N, G, 16]
    codes = np.empty((num_out, num_in // GROUP_SIZE, GROUP_SIZE), np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=codes[..., :16])
    np.right_shift(nibbles, 4, out=codes[..., 16:])
    codes = torch.from_numpy(codes.reshape(num_out, num_in))
    if qtype == "Q4_0":
        zeros = np.zeros_like(d)
    else:
        zeros = blocks[..., 2:4].view(np.float16)[..., 0].astype(np.float32) + 8 * d
    d, zeros = torch.from_numpy(d), torch.from_numpy(zeros)
    return QuantizedWeight("int4", codes, d, zeros, GROUP_SIZE)


@dataclass(slots=True)
class WeightFormat:
    """How the linear weights of one rank are stored (set on the layers before loading).

    Attributes:
        dtype: compute dtype (activations, scales of the packed kernels).
        keep_gguf: keep GGUF Q4_0/Q4_1/Q8_0 tensors in integer form instead of dequantizing them.
        quantize: ``"int4"`` / ``"int8"`` to quantize float weights at load time, or None.
        dense_rows: packed weights also keep a dense copy in ``dtype`` for matmuls of at least this
            many input rows (``--packed-dense-rows``, :func:`kernels.packed_linear.packed_matmul`); 0 = none.
    """

    dtype: torch.dtype
    keep_gguf: bool = True
    quantize: str | None = None
    dense_rows: int = 0

    def integer_kind(self, quant_type: str | None, shape: tuple[int, ...], embedding: bool = False) -> str | None:
        """The kind of integer form (``"int4"`` / ``"int8"``) a checkpoint tensor gets, or None to load it as
        floats, from its metadata only: GGUF type ``quant_type`` (None: a float tensor) and full ``shape``.
        Embeddings / LM heads take only the int8 form (one scale per vocab row also serves the lookup);
        ``--quantization int4`` stores them as int8. The meta-device build decides each layer's format
        with it before any weight is read (:func:`workers.layers.quantized.apply_weight_format`)."""
        if self.keep_gguf and quant_type in PACKED_GGUF_TYPES:
            if embedding and quant_type != "Q8_0":
                return None
            return "int8" if quant_type == "Q8_0" else "int4"
        if self.quantize is None or quant_type is not None or len(shape) != 2:
            return None
        if embedding or self.quantize == "int8":
            return "int8"
        return None if shape[1] % GROUP_SIZE else "int4"

    def integer_form(self, tensor, embedding: bool = False) -> QuantizedWeight | None:
        """The whole checkpoint ``tensor`` (a ``LazyTensor``) in integer form (the kind
        :meth:`integer_kind` names), or None to load it as floats."""
        kind = self.integer_kind(tensor.quant_type, tuple(tensor.shape), embedding)
        if kind is None:
            return None
        if tensor.quant_type is not None:
            return tensor.quantized()
        return quantize_int8(tensor.load()) if kind == "int8" else quantize_int4(tensor.load())


DENSE_COPY_SHARE = 0.25   # of the host's available memory that ``--packed-dense-rows auto`` may spend on copies


def dense_copy_bytes(ckpt, dtype: torch.dtype) -> int:
    """Bytes that dense ``dtype`` copies of every matrix of ``ckpt`` (a ``workers.checkpoint.Checkpoint``)
    would take, from tensor shapes only: an upper bound on what ``--packed-dense-rows`` adds to the
    whole replica (every TP rank's share together; norms and biases are 1-D and never copied)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) * itemsize for shape in (ckpt.get(name).shape for name in ckpt.names())
               if len(shape) == 2)


def weight_format_for(dtype: torch.dtype, quantization: str, is_gguf: bool, packed_dense_rows: str = "0",
                      ckpt=None) -> WeightFormat | None:
    """The :class:`WeightFormat` of a run, or None for plain dense weights.

    A GGUF file keeps its Q4_0/Q4_1/Q8_0 tensors packed when computing in bfloat16 (the kernels'
    fast path; float32 is the exact dequantized path, float16 runs them slowly on CPU);
    ``--quantization`` packs float weights in whatever dtype was asked for. ``packed_dense_rows``
    (``--packed-dense-rows``): a row count as text (``"0"`` = no dense copies) or ``"auto"``:
    :func:`kernels.packed_linear.dense_rows_auto` (measured on this CPU), and none when the copies of
    ``ckpt``'s matrices (:func:`dense_copy_bytes`; ``ckpt`` is needed for ``"auto"``) would take more
    than :data:`DENSE_COPY_SHARE` of the host's available memory: they roughly quadruple a Q4 model's
    weights, which a large model on a small machine cannot afford (a row count asked for explicitly is
    kept)."""
    if quantization == "none" and not (is_gguf and dtype == torch.bfloat16):
        return None
    if packed_dense_rows != "auto":
        dense_rows = int(packed_dense_rows)
    elif (dense_bytes := dense_copy_bytes(ckpt, dtype)) > DENSE_COPY_SHARE * psutil.virtual_memory().available:
        logger.info("--packed-dense-rows auto: no dense copies (%.1f GiB would exceed %d%% of the host's available "
                    "memory)", dense_bytes / 2**30, round(100 * DENSE_COPY_SHARE))
        dense_rows = 0
    else:
        dense_rows = dense_rows_auto(dtype)
        logger.info("--packed-dense-rows auto: %s", f"dense copies for matmuls of >= {dense_rows} rows" if dense_rows
                    else f"no dense copies (a {str(dtype).removeprefix('torch.')} matmul of 16 rows is not clearly "
                         "faster than the packed kernel on this CPU)")
    if quantization != "none":
        return WeightFormat(dtype, keep_gguf=False, quantize=quantization, dense_rows=dense_rows)
    return WeightFormat(dtype, dense_rows=dense_rows)


def check_packed_dense_rows(value: str) -> str:
    """``value`` when it is a valid ``--packed-dense-rows`` (``auto`` or an integer >= 0).

    Raises:
        ValueError: anything else.
    """
    if value != "auto" and not (value.isascii() and value.isdigit()):
        raise ValueError(f"--packed-dense-rows must be auto or an integer >= 0 (0 = no dense copies), got {value!r}")
    return value
