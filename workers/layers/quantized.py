"""Packed weights inside the parallel layers: collected while loading, packed once after.

A layer whose ``weight_format`` is set (:func:`apply_weight_format`, before loading) asks it, per
checkpoint tensor, for the tensor's integer form (:class:`~workers.quantization.QuantizedWeight`),
cuts its own rows or columns out of it (whole quantization groups only) and keeps that part in
:class:`PackStaging` instead of writing floats. :func:`process_weights_after_loading` then packs
each layer whose parts are all of one kind and fit the kernels into a :class:`PackedWeight`, and
drops the (never written, so never resident) float parameter. A layer with a part that had no
integer form, parts of different kinds (a Q8_0 V beside Q4_1 Q/K) or a shape the kernels reject
gets its parts dequantized into the float weight instead: always correct, only slower.
"""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.packed_linear import int4_supported, int8_supported, pack_int4, packed_matmul
from shardserve.workers.quantization import GROUP_SIZE, QuantizedWeight, WeightFormat


class PackedWeight:
    """One ``[N, K]`` weight in a CPU kernel's layout.

    Args:
        weight: the integer form (int4 group-wise or int8 per row).
        dtype: compute dtype (the kernels' scales are stored in it).
        dense_rows: also keep the weight dense (``[N, K]`` in ``dtype``) and run inputs of at least
            this many rows on it (:func:`kernels.packed_linear.packed_matmul`); 0 = packed only.

    Attributes:
        kind: ``"int4"`` or ``"int8"``. shape: ``(N, K)``.
        row_scales: int8 only: ``[N]`` float32 scales, for embedding lookups.
        dense: the dense copy, or None.
    """

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, dense_rows: int = 0) -> None:
        self.kind, self.shape, self.dtype, self.dense_rows = weight.kind, weight.shape, dtype, dense_rows
        self.group_size = weight.group_size
        if weight.kind == "int4":
            self.packed, self.scale_zeros = pack_int4(weight.codes, weight.scales, weight.zeros, dtype)
            self._kernel = [self.packed, self.scale_zeros]
        else:
            self.qweight = weight.codes.contiguous()
            self.row_scales = weight.scales.float().contiguous()
            self.scales = self.row_scales.to(dtype)
            self._kernel = [self.qweight, self.scales]
        # the values the packed kernel computes with: scales (and zeros) rounded to the compute dtype
        self.dense = dense_weight(weight, dtype) if dense_rows else None
        if self.dense is not None:
            self._kernel.append(self.dense)

    @staticmethod
    def supported(weight: QuantizedWeight) -> bool:
        """Whether the kernel for ``weight.kind`` takes its shape."""
        num_out, num_in = weight.shape
        if weight.kind == "int4":
            return int4_supported(num_out, num_in, weight.group_size)
        return int8_supported(num_out, num_in)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] -> x @ W^T [M, N]`` in the compute dtype (the dense copy from ``dense_rows`` rows)."""
        return packed_matmul(x, self._kernel, self.kind, self.group_size, self.dense_rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [T]`` of W (int8 only: embeddings), ``[T, K]`` in the compute dtype."""
        return (self.qweight[ids].float() * self.row_scales[ids, None]).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this weight keeps (a weight reload copies new contents into them in place)."""
        kept = [self.packed, self.scale_zeros] if self.kind == "int4" else [self.qweight, self.row_scales, self.scales]
        return kept if self.dense is None else kept + [self.dense]

    def same_layout(self, weight: QuantizedWeight) -> bool:
        """Whether ``weight`` packs into tensors of exactly this weight's shapes."""
        return (weight.kind == self.kind and tuple(weight.shape) == tuple(self.shape)
                and (self.kind == "int8" or weight.group_size == self.group_size))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def dense_weight(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` in ``dtype``: the weight the packed kernel computes with, its scales and zeros
    rounded to ``dtype`` first as the kernel stores them (the int8 kernel's scales likewise)."""
    rounded = QuantizedWeight(weight.kind, weight.codes, weight.scales.to(dtype).float(),
                              None if weight.zeros is None else weight.zeros.to(dtype).float(), weight.group_size)
    return rounded.dequantize().to(dtype).contiguous()


class PackStaging:
    """The integer-form parts a layer's loader collected, by shard id (None: loaded as floats)."""

    def __init__(self, fmt: WeightFormat, embedding: bool = False) -> None:
        self.fmt, self.embedding = fmt, embedding
        self.parts: dict[int, QuantizedWeight | None] = {}

    def take(self, shard_id: int, tensor, cut) -> bool:
        """Keep ``cut(integer form of tensor)`` for ``shard_id``; False (and nothing kept) when the
        tensor has no integer form or the cut splits a group: the caller then loads floats."""
        whole = self.fmt.integer_form(tensor, self.embedding)
        part = None if whole is None else cut(whole)
        self.parts[shard_id] = part
        return part is not None

    def merged(self) -> QuantizedWeight | None:
        """All parts stacked along rows when every part has an integer form of one kind that a
        kernel takes; else None."""
        if not self.parts or any(p is None for p in self.parts.values()):
            return None
        merged = QuantizedWeight.cat_rows([self.parts[i] for i in sorted(self.parts)])
        return merged if merged is not None and PackedWeight.supported(merged) else None


def packed_nbytes(kind: str, shape: tuple[int, int], dtype: torch.dtype, group_size: int = GROUP_SIZE) -> int:
    """Bytes a :class:`PackedWeight` of ``kind`` and shape ``[N, K]`` keeps without its dense copy
    (:attr:`PackedWeight.nbytes` less ``dense``, from the shapes alone): int4 ``[N, K / 2]`` uint8 codes
    + ``[K / group, N, 2]`` scales and zeros in ``dtype``; int8 ``[N, K]`` codes + ``[N]`` float32 and
    ``[N]`` ``dtype`` scales."""
    num_out, num_in = shape
    if kind == "int4":
        return num_out * num_in // 2 + num_in // group_size * num_out * 2 * dtype.itemsize
    return num_out * num_in + num_out * (4 + dtype.itemsize)


def _packed_kind(model: nn.Module, name: str, module: nn.Module, ckpt, fmt: WeightFormat) -> str | None:
    """What :func:`process_weights_after_loading` will make of ``module`` (qualified ``name``): the
    packed kind, or None (float weight), decided from the checkpoint's metadata before any read.
    The same rules as loading: every part has an integer form of one kind (:meth:`WeightFormat.integer_kind`),
    a row-parallel int4 slice keeps whole groups, and the kernel takes the local shape."""
    from shardserve.workers.weight_loader import checkpoint_sources

    embedding = getattr(module, "is_embedding", False)
    kinds = {fmt.integer_kind(ckpt.get(src).quant_type if src in ckpt else None, module.checkpoint_shape(shard_id),
                              embedding)
             for src, shard_id in checkpoint_sources(model, f"{name}.weight", ckpt, module.weight)}
    if len(kinds) != 1 or None in kinds:
        return None
    (kind,) = kinds
    if kind == "int4" and not getattr(module, "keeps_groups", lambda size: True)(GROUP_SIZE):
        return None
    num_out, num_in = module.weight.shape
    supported = int4_supported(num_out, num_in, GROUP_SIZE) if kind == "int4" else int8_supported(num_out, num_in)
    return kind if supported else None


def apply_weight_format(model: nn.Module, fmt: WeightFormat, ckpt) -> None:
    """Before loading (on the meta-device model): let every packable layer of ``model`` in the
    compute dtype collect integer forms, and decide from ``ckpt``'s metadata which of them will
    be packed. The weight parameter of such a layer is marked ``packed_kind`` (and ``packed_nbytes``,
    ``dense_nbytes`` for its dense copy): it stays on the meta device, never allocated, and is replaced
    by the packed weight after loading. Layers whose weight is read directly (``fp8_allowed = False``: MLA's
    absorbed ``kv_b_proj``) and layers kept in another dtype (the DSA indexer's float32 head
    weights) stay as they are."""
    decided = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (getattr(module, "packable", False) and getattr(module, "fp8_allowed", True) and weight is not None
                and weight.dtype == fmt.dtype):
            module.staging = PackStaging(fmt, embedding=getattr(module, "is_embedding", False))
            module.weight_format = fmt   # kept: a weight reload stages this layer's parts again
            if id(weight) in decided:    # a tied LM head: its embedding's weight decides
                continue
            decided.add(id(weight))
            kind = _packed_kind(model, name, module, ckpt, fmt)
            if kind is not None:
                weight.packed_kind = kind
                weight.packed_nbytes = packed_nbytes(kind, tuple(weight.shape), fmt.dtype)
                weight.dense_nbytes = weight.numel() * fmt.dtype.itemsize if fmt.dense_rows else 0


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """After loading: pack every layer whose staged parts allow it, dequantize the rest into their
    float weights (see the module docstring)."""
    for module in model.modules():
        staging = getattr(module, "staging", None)
        if staging is None:
            continue
        module.staging = None
        merged = staging.merged()
        if merged is not None:
            module.set_packed(PackedWeight(merged, staging.fmt.dtype, staging.fmt.dense_rows))
            continue
        if not staging.parts:       # a tied LM head: its embedding's loader staged the parts
            continue
        if module.weight.is_meta:   # NOTE: apply_weight_format's decision and loading disagree: a bug
            raise RuntimeError(f"{type(module).__name__} {tuple(module.weight.shape)} was planned "
                               f"{module.weight.packed_kind} but its parts do not pack")
        for shard_id, part in staging.parts.items():
            if part is not None:
                module.dense_slot(shard_id).copy_(part.dequantize())
    for module in model.modules():   # a tied LM head shares its embedding's packed weight
        shared = getattr(getattr(module, "weight", None), "packed_as", None)
        if shared is not None:
            module.set_packed(shared)
