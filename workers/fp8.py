"""FP8 block-scaled checkpoints (DeepSeek-V3 format), dequantized at load time.

A quantized linear weight ``W`` ``[out, in]`` is stored as ``X.weight`` (``float8_e4m3fn``) plus
``X.weight_scale_inv`` (float32) ``[ceil(out / bo), ceil(in / bi)]``, one scale per
``bo x bi`` block (``quantization_config.weight_block_size``, DeepSeek-V3 uses 128 x 128; edge
blocks are partial). The real weight is ``W[i, j] = X.weight[i, j] * scale_inv[i // bo, j // bi]``
(DeepSeek-V3 ``inference/fp8_cast_bf16.py`` / ``kernel.py: weight_dequant``).

:func:`dequantizing_checkpoint` wraps a checkpoint so that every such weight reads as float32
(only the requested slice and the scale rows/columns that cover it), and the rest of loading is
unchanged: the CPU path, where activations are *not* quantized and the engine computes in the
runner's dtype with the dequantized weights. On GPUs :func:`keep_fp8_weights` first switches the
linear layers and the routed experts to FP8 storage (their weights stay 1 byte per element and run
through the block-scaled Triton kernels); layers whose tensor-parallel slices cut a scale block, and
``kv_b_proj`` (read directly by absorbed MLA decode), are still dequantized.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from shardserve.workers.checkpoint import Checkpoint, CheckpointError, LazyTensor

SCALE_SUFFIX = "weight_scale_inv"
DEFAULT_BLOCK_SIZE = (128, 128)


def block_size_of(config) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of an HF config, or 128 x 128."""
    block = quantization_config(config).get("weight_block_size") or DEFAULT_BLOCK_SIZE
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


def quantization_config(config) -> dict:
    """``config.quantization_config`` as a dict (empty when the checkpoint is not quantized)."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    return quant


def is_block_fp8(ckpt: Checkpoint, config) -> bool:
    """Whether ``ckpt`` holds block-scaled FP8 weights: ``config.quantization_config.quant_method ==
    "fp8"`` or any tensor name ends in ``weight_scale_inv`` (never for GGUF files)."""
    from shardserve.workers.checkpoint import GGUFCheckpoint

    if isinstance(ckpt, GGUFCheckpoint):
        return False
    return (quantization_config(config).get("quant_method") == "fp8"
            or any(name.endswith(SCALE_SUFFIX) for name in ckpt.names()))


def dequantizing_checkpoint(ckpt: Checkpoint, config) -> Checkpoint:
    """Wrap ``ckpt`` in :class:`Fp8DequantCheckpoint` when it holds block-scaled FP8 weights
    (:func:`is_block_fp8`); otherwise (or when wrapped already) ``ckpt`` is returned unchanged."""
    if isinstance(ckpt, Fp8DequantCheckpoint):
        return ckpt
    return Fp8DequantCheckpoint(ckpt, block_size_of(config)) if is_block_fp8(ckpt, config) else ckpt


# Linear layers the released FP8 checkpoints (DeepSeek-V3 / V3.2, GLM-5) keep unquantized, by module
# name. DeepSeek-V3.2-Exp ``inference/model.py``: "weights_proj in the checkpoint is stored in bf16".
# Embeddings, LM heads, norms and MoE routers are no linear layers of ours, so never asked about.
UNQUANTIZED_LINEARS = ("weights_proj",)


def released_fp8_weight(weight_name: str, config) -> bool:
    """Whether a released block-FP8 checkpoint of ``config`` stores linear weight ``weight_name``
    (``...X.weight``) in FP8 with a ``weight_scale_inv``: ``quant_method == "fp8"``, and the module
    is neither in :data:`UNQUANTIZED_LINEARS` nor matched by the config's ``modules_to_not_convert``
    (substrings of the module name, as transformers' FP8 integration reads them). ``config`` may
    also be its ``quantization_config`` dict. Used to plan a model from its ``config.json`` alone
    (``workers/plan.py``)."""
    quant = config if isinstance(config, dict) else quantization_config(config)
    if quant.get("quant_method") != "fp8":
        return False
    module = weight_name.removesuffix(".weight")
    skipped = (*UNQUANTIZED_LINEARS, *(quant.get("modules_to_not_convert") or ()))
    return not any(part in module for part in skipped)


# -- FP8 kept on the GPU ------------------------------------------------------------------------

def _column_aligned(layer, block: tuple[int, int]) -> bool:
    """Every packed shard starts on a scale-block row, in the checkpoint and in the local weight."""
    return all(start % block[0] == 0 and offset % block[0] == 0
               for (_, start, _), offset in zip(layer.shards, layer.offsets))


def keeps_fp8(device: str | torch.device) -> bool:
    """Whether FP8 block-scaled weights stay FP8 on ``device`` (else they are dequantized at load).

    Only CUDA GPUs whose Triton kernels take ``float8_e4m3fn`` operands keep them: compute capability
    8.9 and up (Ada, Hopper, Blackwell). Triton refuses e4m3 on older GPUs ("type fp8e4nv not
    supported in this architecture" for sm_80, the A100: ``benchmarks/triton_compile.py --arch 80``),
    so there the weights are dequantized to the runner's dtype, as on CPU (twice the bytes), and the
    runner refuses the FP8 indexer cache. Planning without a visible GPU (``shardserve plan --device
    cuda``) assumes one that keeps them.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def keep_fp8_weights(model: nn.Module, raw: Checkpoint, block_size: tuple[int, int]) -> list[str]:
    """Keep FP8 block-scaled weights in FP8 on the model (the GPU path): linear layers
    (:func:`keep_fp8_linears`) and routed experts (:func:`keep_fp8_experts`).

    Returns:
        names of the switched modules.
    """
    return keep_fp8_linears(model, raw, block_size) + keep_fp8_experts(model, raw, block_size)


def keep_fp8_experts(model: nn.Module, raw: Checkpoint, block_size: tuple[int, int]) -> list[str]:
    """Switch :class:`workers.models.moe.FusedExperts` to FP8 storage where every expert tensor has
    a ``weight_scale_inv`` and the expert's intermediate size is a multiple of the scale block's
    rows (gate and up rows of the stacked ``w13`` then never share a scale block). A switched
    module holds ``w13_weight`` / ``w2_weight`` as ``float8_e4m3fn`` and ``w13_weight_scale_inv``
    ``[E, 2 * I / bo, ceil(H / bi)]`` / ``w2_weight_scale_inv`` ``[E, ceil(H / bo), ceil(I / bi)]``,
    each filled from its experts' tensors (experts are never split across ranks, so no slice can cut
    a block), and runs :func:`kernels.fused_moe` on them.

    Returns:
        names of the switched modules.
    """
    from shardserve.workers.models.moe import FusedExperts
    from shardserve.workers.weight_loader import checkpoint_sources

    kept = []
    for name, experts in model.named_modules():
        if not isinstance(experts, FusedExperts) or experts.intermediate_size % block_size[0]:
            continue
        sources = [src for param_name in ("w13_weight", "w2_weight")
                   for src, _ in checkpoint_sources(model, f"{name}.{param_name}", raw, getattr(experts, param_name))]
        if not sources or not all(src[: -len("weight")] + SCALE_SUFFIX in raw for src in sources):
            continue
        for param_name in ("w13_weight", "w2_weight"):
            old = getattr(experts, param_name)
            rows, cols = old.shape[1:]
            weight = nn.Parameter(torch.empty(old.shape, dtype=torch.float8_e4m3fn, device=old.device),
                                  requires_grad=False)
            scale = nn.Parameter(torch.empty(old.shape[0], math.ceil(rows / block_size[0]),
                                             math.ceil(cols / block_size[1]), device=old.device), requires_grad=False)
            weight.checkpoint_parts = old.checkpoint_parts
            scale.checkpoint_parts = [(part[: -len("weight")] + SCALE_SUFFIX, shard) for part, shard in old.checkpoint_parts]
            half_rows = rows // 2 if param_name == "w13_weight" else rows   # rows of one checkpoint tensor
            weight.weight_loader = functools.partial(_load_fp8_expert, raw, half_rows, 1, param_name == "w13_weight")
            scale.weight_loader = functools.partial(_load_fp8_expert, raw, half_rows, block_size[0],
                                                    param_name == "w13_weight")
            setattr(experts, param_name, weight)
            setattr(experts, f"{param_name}_scale_inv", scale)
        experts.block_size = block_size
        kept.append(name)
    return kept


def _load_fp8_expert(raw: Checkpoint, rows: int, rows_per_entry: int, stacked: bool, param: nn.Parameter,
                     tensor: LazyTensor, shard_id: int) -> None:
    """Copy one expert tensor (or its scales) raw: ``shard_id`` is ``2 * local expert + (0 gate,
    1 up)`` for the stacked ``w13``, the local expert for ``w2`` (see ``FusedExperts``)."""
    name = tensor.name
    source = raw.require(name)
    count = math.ceil(rows / rows_per_entry)
    expert, half = (shard_id // 2, shard_id % 2) if stacked else (shard_id, 0)
    if source.shape[0] != count or tuple(source.shape[1:]) != tuple(param.shape[2:]):
        raise CheckpointError(f"{source.file}: tensor {name!r} has shape {list(source.shape)}, expected "
                              f"{[count, *param.shape[2:]]}")
    param.data[expert, half * count:(half + 1) * count].copy_(source.load())


def keep_fp8_linears(model: nn.Module, raw: Checkpoint, block_size: tuple[int, int]) -> list[str]:
    """Switch column/row-parallel linears to FP8 storage where the checkpoint allows it (GPU path).

    A layer is switched when every checkpoint tensor it reads has a ``weight_scale_inv``, its
    ``fp8_allowed`` is True, and this rank's slices start on scale-block boundaries (uneven or
    odd tensor-parallel splits that cut a scale block keep the dequantized weight). A switched layer
    holds ``weight`` as ``float8_e4m3fn`` and ``weight_scale_inv`` ``[ceil(rows / bo), ceil(cols / bi)]``
    float32 for its own slice, both filled by their ``weight_loader`` from ``raw``, and runs
    :func:`kernels.fp8_block_linear` (see :func:`workers.layers.linear.linear`).

    Args:
        model: built (not yet loaded) model, on any device.
        raw: the checkpoint without dequantization (FP8 tensors and their scales).
        block_size: ``(bo, bi)`` of the checkpoint.

    Returns:
        names of the switched modules.
    """
    from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shardserve.workers.weight_loader import checkpoint_sources

    kept = []
    for name, layer in model.named_modules():
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or not layer.fp8_allowed:
            continue
        sources = [src for src, _ in checkpoint_sources(model, f"{name}.weight", raw, layer.weight)]
        if not all(src.endswith(".weight") and src[: -len("weight")] + SCALE_SUFFIX in raw for src in sources):
            continue
        column = isinstance(layer, ColumnParallelLinear)
        if column and not _column_aligned(layer, block_size):
            continue
        if not column and layer.local_start % block_size[1]:
            continue
        rows, cols = layer.weight.shape
        device = layer.weight.device
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
                                    requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(
            torch.empty(math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1]), device=device),
            requires_grad=False)
        layer.block_size = block_size
        loader = _load_fp8_column if column else _load_fp8_row
        layer.weight.weight_loader = functools.partial(loader, layer, raw, False)
        layer.weight_scale_inv.weight_loader = functools.partial(loader, layer, raw, True)
        kept.append(name)
    return kept


def _load_fp8_column(layer, raw: Checkpoint, is_scale: bool, param: nn.Parameter, tensor: LazyTensor,
                     shard_id: int = 0) -> None:
    """Copy packed shard ``shard_id``'s rows (or their scale rows) from the raw checkpoint."""
    full, start, size = layer.shards[shard_id]
    offset = layer.offsets[shard_id]
    name = tensor.name if tensor.name.endswith(SCALE_SUFFIX) else tensor.name[: -len("weight")] + SCALE_SUFFIX
    if not is_scale:
        source = raw.require(tensor.name)
        source.check_shape((full, layer.in_features))
        param.data[offset:offset + size].copy_(source[start:start + size])
        return
    block_rows = layer.block_size[0]
    source = raw.require(name, (math.ceil(full / block_rows), math.ceil(layer.in_features / layer.block_size[1])))
    count = math.ceil(size / block_rows)
    param.data[offset // block_rows:offset // block_rows + count].copy_(source[start // block_rows:start // block_rows + count])


def _load_fp8_row(layer, raw: Checkpoint, is_scale: bool, param: nn.Parameter, tensor: LazyTensor,
                  shard_id: int = 0) -> None:
    """Copy this rank's columns (or their scale columns) from the raw checkpoint."""
    start, size = layer.local_start, layer.local_size
    if not is_scale:
        source = raw.require(tensor.name, (layer.out_features, layer.in_features))
        param.data.copy_(source[:, start:start + size])
        return
    block_rows, block_cols = layer.block_size
    name = tensor.name if tensor.name.endswith(SCALE_SUFFIX) else tensor.name[: -len("weight")] + SCALE_SUFFIX
    source = raw.require(name, (math.ceil(layer.out_features / block_rows), math.ceil(layer.in_features / block_cols)))
    param.data.copy_(source[:, start // block_cols:start // block_cols + math.ceil(size / block_cols)])
