"""Hot-swap of changed weights on one rank (shard worker or MTP draft worker).

ik_llama.cpp (one of the seed PRs) reloads only the tensors whose contents changed in the file, in
one process; its follow-ups had to add tensor shape validation and invalidate CUDA graphs after a
swap. Here the same idea runs on every rank of a tensor-parallel replica, and each rank compares
only its own slices:

- A rank's *digest* of a checkpoint read is xxh3-64 over the bytes the read returned, keyed by
  ``(tensor name, index)``: exactly the slice this rank loaded (its rows of a column-parallel
  weight, its experts, the whole tensor for a replicated one; FP8 weights and their scales as
  stored). Digests are taken while the weights load (a :class:`ReadRecorder` observes the
  checkpoint), so a later reload needs no second copy of the model.
- :func:`stage_weights` reopens the rank's checkpoint object on the new files (loaders bound to it,
  like those of FP8 weights kept on GPUs, then read them too), reads every parameter through its
  own ``weight_loader`` into a host scratch tensor, keeps the scratch only when a read's digest
  differs, and writes nothing into the model. :meth:`StagedWeights.commit` then copies the kept
  tensors into the existing parameter storage (``param.data.copy_``): no reallocation, so data
  pointers (and CUDA graphs captured on them) stay valid.
- The coordinator stages on every rank first and commits only when all of them staged, so a read
  that fails anywhere leaves the old weights in place byte for byte.

NOTE: everything computed with the old weights (KV / latent, DSA indexer keys, MTP draft caches,
the prefix cache's hashes) is stale after a commit; :func:`reset_caches` zeroes a model's cache
tensors in place and the coordinator drops the prefix cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import xxhash
from torch import nn

from shardserve.workers.checkpoint import Checkpoint, LazyTensor, open_checkpoint
from shardserve.workers.torch_thread import on_torch_thread

ReadKey = tuple[str, str]   # (checkpoint tensor name, repr of the index this rank read)


def tensor_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of a CPU tensor's bytes (any dtype, any shape)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))


@dataclass(slots=True)
class WeightRecord:
    """What a rank loaded: a digest per read and the shape of every tensor it read.

    Attributes:
        digests: ``(name, repr(index)) -> xxh3-64`` of the bytes each read returned.
        shapes: checkpoint tensor name -> shape (the served checkpoint, as far as the model reads it).
    """

    digests: dict[ReadKey, int] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _fingerprint: int | None = None

    def fingerprint(self) -> int:
        """One xxh3-64 over every read digest (order-independent): equal fingerprints mean the
        same bytes were loaded."""
        if self._fingerprint is None:
            h = xxhash.xxh3_64()
            for key in sorted(self.digests):
                h.update(f"{key[0]}\0{key[1]}\0{self.digests[key]}\n".encode())
            self._fingerprint = h.intdigest()
        return self._fingerprint


class ReadRecorder:
    """A checkpoint's :attr:`workers.checkpoint.Checkpoint.observer` that digests every read.

    Attributes:
        record: digests and shapes of everything read so far.
        reads: the keys read since the last :meth:`take_reads`, in order.
    """

    def __init__(self) -> None:
        self.record = WeightRecord()
        self.reads: list[ReadKey] = []

    def __call__(self, tensor: LazyTensor, index: tuple, out: torch.Tensor) -> None:
        key = (tensor.name, repr(index))
        self.record.digests[key] = tensor_digest(out)
        self.record.shapes[tensor.name] = tuple(tensor.shape)
        self.reads.append(key)

    def take_reads(self) -> list[ReadKey]:
        """The keys read since the previous call."""
        reads, self.reads = self.reads, []
        return reads


def open_recorded(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint whose reads a :class:`ReadRecorder` digests (``ckpt.observer.record``).
    Digests cover the raw bytes read (FP8 weights and their scales as stored), so they do not
    depend on how a parameter keeps them.

    Raises:
        CheckpointError: the files cannot be opened.
    """
    ckpt = open_checkpoint(path)
    ckpt.observer = ReadRecorder()
    return ckpt


def param_sources(model: nn.Module, ckpt: Checkpoint) -> Iterator[tuple[str, nn.Parameter, list[tuple[str, int]]]]:
    """``(parameter name, parameter, [(checkpoint tensor, shard id)])`` for every parameter, with the
    names the model's loader uses (``checkpoint_name`` of a draft model, packed modules unpacked)."""
    from shardserve.workers.weight_loader import checkpoint_sources

    names = set(ckpt.names())
    rename = getattr(model, "checkpoint_name", None)
    for name, param in model.named_parameters():
        key = rename(name, names) if rename is not None else name
        yield name, param, checkpoint_sources(model, key, ckpt, param)


@dataclass(slots=True)
class StagedWeights:
    """A reload read and compared, not yet applied.

    Attributes:
        updates: ``(parameter or packed-weight tensor, host tensor with its new contents)`` for every
            changed one.
        changed: checkpoint tensors with at least one read whose digest changed.
        read: every checkpoint tensor this rank read.
        record: the digests and shapes to keep after a commit.
    """

    updates: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    changed: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)
    record: WeightRecord = field(default_factory=WeightRecord)

    @torch.no_grad()
    def commit(self) -> int:
        """Copy every staged tensor into its parameter's existing storage; returns bytes copied."""
        copied = 0
        for param, new in self.updates:
            pointer = param.data.data_ptr()
            param.data.copy_(new)
            assert param.data.data_ptr() == pointer, "a weight reload must not reallocate parameter storage"
            copied += new.numel() * new.element_size()
        self.updates = []
        return copied


@torch.no_grad()
def stage_weights(model: nn.Module, ckpt: Checkpoint, hf_config, old: WeightRecord) -> StagedWeights:
    """Read ``ckpt`` for every parameter of ``model`` into host scratch tensors and keep those
    whose reads changed (see the module docstring). The model is not touched.

    Args:
        model: the loaded model (its parameters' ``weight_loader`` read the slices).
        ckpt: the checkpoint the model was loaded from, reopened on the new files, with a fresh
            :class:`ReadRecorder` (loaders that hold it read the new files too).
        hf_config: the model's config (FP8 block-scaled weights are read as the loader did).
        old: what was recorded when the current weights were loaded.

    Raises:
        CheckpointError: a tensor is missing, has the wrong shape, or cannot be read.
    """
    from shardserve.workers.fp8 import dequantizing_checkpoint
    from shardserve.workers.weight_loader import default_weight_loader

    view, recorder = dequantizing_checkpoint(ckpt, hf_config), ckpt.observer
    staged = StagedWeights()
    recorder.take_reads()
    for _, param, sources in param_sources(model, view):
        loader = getattr(param, "weight_loader", default_weight_loader)
        # Host copy of the current contents: a loader that fills only part of a parameter leaves
        # the rest as it is, exactly as in the model. The model itself is untouched.
        scratch = param.detach().to("cpu", copy=True)
        for ckpt_name, shard_id in sources:
            loader(scratch, view.require(ckpt_name), shard_id)
        changed = {key[0] for key in recorder.take_reads() if recorder.record.digests[key] != old.digests.get(key)}
        staged.read.update(name for name, _ in sources)
        if changed:
            staged.changed |= changed
            staged.updates.append((param, scratch))
    _stage_packed(model, view, recorder, old, staged)
    staged.record = recorder.record
    return staged


@torch.no_grad()
def _stage_packed(model: nn.Module, view: Checkpoint, recorder: ReadRecorder, old: WeightRecord,
                  staged: StagedWeights) -> None:
    """Packed layers (``workers/layers/quantized.py``) have no float parameter: their loader reads
    each part again into a fresh staging, the parts are packed again, and the new tensors are kept
    when a read changed (a weight tied to another layer's is staged once).

    Raises:
        CheckpointError: a changed tensor no longer packs into the same layout (another GGUF type
            or group size): only a restart of the replica can load it.
    """
    from shardserve.workers.checkpoint import CheckpointError
    from shardserve.workers.layers.quantized import PackedWeight, PackStaging
    from shardserve.workers.weight_loader import checkpoint_sources

    names, rename, seen = set(view.names()), getattr(model, "checkpoint_name", None), set()
    for module_name, module in model.named_modules():
        packed = getattr(module, "packed", None)
        if packed is None or id(packed) in seen:
            continue
        seen.add(id(packed))
        key = f"{module_name}.weight"
        sources = checkpoint_sources(model, rename(key, names) if rename is not None else key, view)
        module.staging = PackStaging(module.weight_format, embedding=getattr(module, "is_embedding", False))
        scratch = torch.empty(packed.shape, dtype=packed.dtype)   # where a part without integer form lands
        try:
            for ckpt_name, shard_id in sources:
                module.weight_loader(scratch, view.require(ckpt_name), shard_id)
            merged = module.staging.merged()
        finally:
            module.staging = None
        changed = {key[0] for key in recorder.take_reads() if recorder.record.digests[key] != old.digests.get(key)}
        staged.read.update(name for name, _ in sources)
        if not changed:
            continue
        if merged is None or not packed.same_layout(merged):
            raise CheckpointError(f"tensor {sorted(changed)[0]!r} changed to a form that cannot replace the "
                                  f"packed {packed.kind} weight in place (another quantization type or group "
                                  f"size); restart the replica to load it")
        staged.changed |= changed
        staged.updates.extend(zip(packed.tensors(), PackedWeight(merged, packed.dtype, packed.dense_rows).tensors()))


@torch.no_grad()
def reset_caches(model: nn.Module) -> None:
    """Zero every cache tensor of ``model``'s attention layers in place (KV / MLA latent, DSA
    indexer keys): nothing computed with other weights survives, and no pointer changes."""
    for layer in model.attention_layers():
        for cache in layer.kv_cache or ():
            cache.zero_()



class ReloadableRank:
    """Recovery and reload methods of a rank actor (mixed into ``ShardWorker`` and ``DraftWorker``).

    A subclass implements :meth:`_weights`: the object that holds ``model``, ``hf_config``,
    ``requests`` (per-request state), ``checkpoint`` (opened with :func:`open_recorded`) and
    ``weight_record`` (:class:`WeightRecord`); it counts ``weight_loads`` (reads of its weights
    from disk at start-up; a reload is not counted).
    """

    weight_loads = 0
    _staged: StagedWeights | None = None

    def _weights(self):
        raise NotImplementedError

    def status(self) -> dict:
        """``{"pid", "weight_loads", "fingerprint"}`` (:meth:`WeightRecord.fingerprint` of the
        loaded bytes); it answers at once, so it is also the liveness ping."""
        holder = self._weights()
        return {"pid": os.getpid(), "weight_loads": self.weight_loads,
                "fingerprint": holder.weight_record.fingerprint() if holder is not None else None}

    @on_torch_thread
    def reset_state(self) -> None:
        """Forget every request and zero the caches (after a peer was replaced or the weights changed);
        a hybrid model's recurrent-state pool is zeroed and forgets every slot's owner (same tensors)."""
        holder = self._weights()
        holder.requests.clear()
        reset_caches(holder.model)
        if getattr(holder, "state_cache", None) is not None:
            holder.state_cache.reset()

    @on_torch_thread
    def stage_reload(self, files) -> dict:
        """Read the checkpoint ``files`` and keep what changed (see :func:`stage_weights`).

        Returns:
            ``{"changed": [tensor names], "read": [tensor names]}`` of this rank.

        Raises:
            CheckpointError: a tensor is missing, misshapen or unreadable (nothing was changed).
        """
        holder = self._weights()
        self._staged = None
        holder.checkpoint.reopen(files.path)
        holder.checkpoint.observer = ReadRecorder()
        self._staged = stage_weights(holder.model, holder.checkpoint, holder.hf_config, holder.weight_record)
        return {"changed": sorted(self._staged.changed), "read": sorted(self._staged.read)}

    @on_torch_thread
    def commit_reload(self) -> int:
        """Apply the staged tensors in place, keep their digests, reset the caches; returns bytes copied."""
        staged, self._staged = self._staged, None
        assert staged is not None, "commit_reload without a successful stage_reload"
        copied = staged.commit()
        self._weights().weight_record = staged.record
        self.reset_state()
        return copied

    def discard_reload(self) -> None:
        """Drop a staged reload (another rank failed to stage)."""
        self._staged = None
