"""Column- and row-parallel linear layers that load only their own slice of each weight.

Each parameter carries a ``weight_loader(param, tensor, shard_id)`` (nano-vllm's pattern):
``tensor`` is a :class:`workers.checkpoint.LazyTensor`, so a rank reads only its rows/columns.
Partitions are explicit ``(start, size)`` row/column ranges so uneven splits by whole units
(``workers/partition.py``) need no special case. Megatron-LM (Shoeybi et al. 2019) column/row rule:
column-parallel outputs stay sharded, row-parallel outputs are summed with one all-reduce.

A layer may hold its weight in FP8 with block scales (``weight_scale_inv``, set up by
:func:`workers.fp8.keep_fp8_linears` on GPUs), or, with a weight format set on CPU
(``workers/layers/quantized.py``), its slice of a quantized weight packed for the CPU kernels
(``packed`` set, ``weight`` None: column slices are whole output rows, row-parallel slices whole
groups of 32 input columns); :func:`linear` runs every kind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels import fp8_block_linear
from shardserve.workers.checkpoint import LazyTensor
from shardserve.workers.compilation import tp_all_reduce
from shardserve.workers.distributed import get_tp_group


def linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` for a layer's ``weight``: a plain matmul, the packed CPU kernel when the
    layer holds a packed weight, or the FP8 block-scaled kernel when the weight is
    ``float8_e4m3fn`` (with ``layer.weight_scale_inv`` and ``layer.block_size``)."""
    packed = getattr(layer, "packed", None)
    if packed is not None:
        out = packed.matmul(x)
        return out if bias is None else out + bias
    if layer.weight.dtype == torch.float8_e4m3fn:
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv, layer.block_size, bias)
    return F.linear(x, layer.weight, bias)


class PackableLinear(nn.Module):
    """What the column- and row-parallel layers share for packed weights (``workers/layers/quantized.py``).

    Attributes:
        packable: may hold a packed weight (not when ``fp8_allowed`` is False: its weight is read directly).
        staging: integer-form parts collected while loading (None: plain float weights).
        packed: the packed weight after loading, or None.
    """

    packable = True

    def __init__(self) -> None:
        super().__init__()
        self.staging = None
        self.packed = None

    def set_packed(self, packed) -> None:
        """Use ``packed`` (a :class:`~workers.layers.quantized.PackedWeight`) instead of ``weight``."""
        self.packed = packed
        self.weight = None


def _check_shape(tensor: LazyTensor, dim: int, expected: int) -> None:
    from shardserve.workers.checkpoint import CheckpointError

    if tensor.shape[dim] != expected:
        raise CheckpointError(
            f"{tensor.file}: tensor {tensor.name!r} has shape {list(tensor.shape)}, "
            f"expected {expected} along dim {dim}")


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T`` with W's output rows split across ranks; one or more logical matrices
    packed side by side (QKV, gate/up).

    Args:
        in_features: full input size.
        shards: per packed matrix, ``(full_out_features, local_start, local_size)``; this rank
            holds rows ``local_start:local_start+local_size`` of each, concatenated.
        bias: whether each packed matrix has a bias.

    Shapes: ``x [T, in_features] -> [T, sum(local_size)]``.
    """

    def __init__(self, in_features: int, shards: list[tuple[int, int, int]], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = shards
        self.fp8_allowed = True   # False: a caller reads `weight` directly, so it must stay in the model dtype
        self.offsets = [0]
        for _, _, size in shards:
            self.offsets.append(self.offsets[-1] + size)
        out_local = self.offsets[-1]
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        """Copy rows ``[local_start, local_start + local_size)`` of ``tensor`` into packed slot ``shard_id``."""
        full, start, size = self.shards[shard_id]
        _check_shape(tensor, 0, full)
        if param.dim() == 2:
            _check_shape(tensor, 1, self.in_features)
            if self.staging is not None and self.staging.take(shard_id, tensor, lambda q: q.rows(start, size)):
                return
        param.data[self.offsets[shard_id]:self.offsets[shard_id] + size].copy_(tensor[start:start + size])

    def dense_slot(self, shard_id: int) -> torch.Tensor:
        """The rows of ``weight`` that packed matrix ``shard_id`` fills."""
        return self.weight.data[self.offsets[shard_id]:self.offsets[shard_id + 1]]

    def checkpoint_shape(self, shard_id: int) -> tuple[int, int]:
        """Full shape of packed matrix ``shard_id``'s checkpoint tensor."""
        return self.shards[shard_id][0], self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x, self.bias)


class RowParallelLinear(PackableLinear):
    """``y = x W^T`` with W's input columns split across ranks, then summed by all-reduce.

    Args:
        in_features: full input size; this rank holds columns ``local_start:local_start+local_size``.
        out_features: full output size.
        reduce_output: all-reduce the partial sums (False lets the caller fuse several partial
            sums into one all-reduce, as MoE does).

    Shapes: ``x [T, local_size] -> [T, out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, local_start: int, local_size: int,
                 bias: bool = False, reduce_output: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.local_start, self.local_size = local_start, local_size
        self.reduce_output = reduce_output
        self.fp8_allowed = True
        self.weight = nn.Parameter(torch.empty(out_features, local_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
        """Copy columns ``[local_start, local_start + local_size)`` (the whole bias)."""
        _check_shape(tensor, 0, self.out_features)
        if param.dim() == 1:
            param.data.copy_(tensor[:])
            return
        _check_shape(tensor, 1, self.in_features)
        if self.staging is not None and self.staging.take(
                shard_id, tensor, lambda q: q.cols(self.local_start, self.local_size)):
            return
        param.data.copy_(tensor[:, self.local_start:self.local_start + self.local_size])

    def dense_slot(self, shard_id: int) -> torch.Tensor:
        return self.weight.data

    def checkpoint_shape(self, shard_id: int) -> tuple[int, int]:
        """Full shape of the checkpoint tensor."""
        return self.out_features, self.in_features

    def keeps_groups(self, group_size: int) -> bool:
        """Whether this rank's input columns are whole groups of ``group_size`` (int4 packing)."""
        return self.local_start % group_size == 0 and self.local_size % group_size == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = get_tp_group()
        out = linear(self, x, None)
        if self.reduce_output and group.tp_size > 1:
            out = tp_all_reduce(out)
        if self.bias is not None and (self.reduce_output or group.tp_rank == 0):
            out = out + self.bias  # once in the sum, not tp_size times
        return out
