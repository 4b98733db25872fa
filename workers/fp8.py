"""FP8 block-scaled checkpoints (DeepSeek-V3 format), dequantized at load time.

A quantized linear weight ``W`` ``[out, in]`` is stored as ``X.weight`` (``float8_e4m3fn``) plus
``X.weight_scale_inv`` (float32) ``[ceil(out / bo), ceil(in / bi)]``, one scale per
``bo x bi`` block (``quantization_config.weight_block_size``, DeepSeek-V3 uses 128 x 128; edge
blocks are partial). The real weight is ``W[i, j] = X.weight[i, j] * scale_inv[i // bo, j // bi]``
(DeepSeek-V3 ``inference/fp8_cast_bf16.py`` / ``kernel.py: weight_dequant``).

:func:`dequantizing_checkpoint` wraps a checkpoint so that every such weight reads as float32
(only the requested slice and the scale rows/columns that cover it), and the rest of loading is
unchanged. Activations are *not* quantized: the engine computes in the runner's dtype with the
dequantized weights.
"""

from __future__ import annotations

import math

import torch

from shardserve.workers.checkpoint import Checkpoint, CheckpointError, LazyTensor

SCALE_SUFFIX = "weight_scale_inv"
DEFAULT_BLOCK_SIZE = (128, 128)


def block_size_of(config) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of an HF config, or 128 x 128."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    block = quant.get("weight_block_size") or DEFAULT_BLOCK_SIZE
    assert len(block) == 2 and all(int(b) > 0 for b in block), f"weight_block_size={block} is not two positive ints"
    return int(block[0]), int(block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                         row_offset: int = 0, col_offset: int = 0) -> torch.Tensor:
    """Dequantize a (possibly sliced) block-scaled FP8 weight.

    Args:
        weight: ``[rows, cols]`` float8_e4m3fn, a window of the full weight starting at
            ``(row_offset, col_offset)``.
        scale_inv: ``[num_row_blocks, num_col_blocks]`` float32 scales covering that window: the
            scale block rows ``row_offset // bo ..`` and columns ``col_offset // bi ..``.
        block_size: ``(bo, bi)``.
        row_offset / col_offset: where the window starts in the full weight.

    Returns:
        ``[rows, cols]`` float32.
    """
    block_rows, block_cols = block_size
    rows, cols = weight.shape
    row_blocks = (torch.arange(rows) + row_offset) // block_rows - row_offset // block_rows   # [rows]
    col_blocks = (torch.arange(cols) + col_offset) // block_cols - col_offset // block_cols   # [cols]
    scales = scale_inv.float()[row_blocks][:, col_blocks]                                     # [rows, cols]
    return weight.float() * scales


def _as_range(index, length: int) -> tuple[int, int] | None:
    """``(start, stop)`` of a step-1 slice over ``length`` elements; None for anything else."""
    if not isinstance(index, slice) or index.step not in (None, 1):
        return None
    start, stop, _ = index.indices(length)
    return start, max(start, stop)


class Fp8DequantCheckpoint(Checkpoint):
    """A view of ``inner`` in which FP8 block-scaled weights read as float32.

    Args:
        inner: the checkpoint to wrap (safetensors).
        block_size: ``(bo, bi)`` from the config's ``quantization_config``.

    Raises (from :meth:`get`):
        CheckpointError: an FP8 weight has no ``weight_scale_inv``, or its scale has the wrong shape.
    """

    def __init__(self, inner: Checkpoint, block_size: tuple[int, int]) -> None:
        self.inner = inner
        self.path = inner.path
        self.block_size = block_size

    def names(self) -> list[str]:
        return self.inner.names()

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def get(self, name: str) -> LazyTensor:
        tensor = self.inner.get(name)
        if not name.endswith(".weight") or len(tensor.shape) != 2 or 0 in tensor.shape:
            return tensor
        scale_name = name[: -len("weight")] + SCALE_SUFFIX
        has_scale = scale_name in self.inner
        if not has_scale:
            # Peek one element: an FP8 weight without its scale must not load as garbage.
            if tensor[0:1, 0:1].dtype == torch.float8_e4m3fn:
                raise CheckpointError(f"{tensor.file}: FP8 tensor {name!r} has no {scale_name!r}")
            return tensor
        scale = self.inner.get(scale_name)
        block_rows, block_cols = self.block_size
        out_features, in_features = tensor.shape
        expected = (math.ceil(out_features / block_rows), math.ceil(in_features / block_cols))
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"{scale.file}: tensor {scale_name!r} has shape {list(scale.shape)}, expected {list(expected)} "
                f"for {name!r} of shape {list(tensor.shape)} with weight_block_size {list(self.block_size)}")
        return LazyTensor(name, tensor.file, tensor.shape, self._reader(tensor, scale))

    def _reader(self, tensor: LazyTensor, scale: LazyTensor):
        block_rows, block_cols = self.block_size
        out_features, in_features = tensor.shape

        def read(index: tuple) -> torch.Tensor:
            index = index + (slice(None),) * (2 - len(index))
            rows, cols = _as_range(index[0], out_features), _as_range(index[1], in_features)
            if rows is None or cols is None or len(index) != 2:
                return read((slice(None), slice(None)))[index]   # unusual index: dequantize whole, then index
            weight = tensor[slice(*rows), slice(*cols)]
            if weight.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{tensor.file}: tensor {tensor.name!r} has a {SCALE_SUFFIX} but dtype "
                                      f"{weight.dtype}, expected torch.float8_e4m3fn")
            if weight.numel() == 0:
                return weight.float()
            row_blocks = slice(rows[0] // block_rows, (rows[1] - 1) // block_rows + 1)
            col_blocks = slice(cols[0] // block_cols, (cols[1] - 1) // block_cols + 1)
            return dequantize_block_fp8(weight, scale[row_blocks, col_blocks], self.block_size, rows[0], cols[0])

        return read


def dequantizing_checkpoint(ckpt: Checkpoint, config) -> Checkpoint:
    """Wrap ``ckpt`` in :class:`Fp8DequantCheckpoint` when it holds block-scaled FP8 weights.

    A checkpoint counts as FP8 when ``config.quantization_config.quant_method == "fp8"`` or any
    tensor name ends in ``weight_scale_inv``; otherwise ``ckpt`` is returned unchanged.
    """
    from shardserve.workers.checkpoint import SafetensorsCheckpoint

    if not isinstance(ckpt, SafetensorsCheckpoint):
        return ckpt
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method == "fp8" or any(name.endswith(SCALE_SUFFIX) for name in ckpt.names()):
        return Fp8DequantCheckpoint(ckpt, block_size_of(config))
    return ckpt
