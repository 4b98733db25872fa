"""Fill a model's parameters from a checkpoint, each through its own ``weight_loader``.

For every parameter we name the checkpoint tensor(s) it comes from (undoing the model's
``packed_modules_mapping``: ``qkv_proj`` <- ``q_proj``/``k_proj``/``v_proj``), then let the
parameter read its own slice. Iterating parameters (not checkpoint tensors) means a missing
tensor is reported by name before the model can run with garbage.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from tqdm import tqdm

from shardserve.workers.checkpoint import Checkpoint, LazyTensor
from shardserve.workers.quantization import WeightFormat


def default_weight_loader(param: nn.Parameter, tensor: LazyTensor, shard_id: int = 0) -> None:
    """Copy a replicated tensor whole, checking its shape."""
    tensor.check_shape(param.shape)
    param.data.copy_(tensor.load())


def checkpoint_sources(model: nn.Module, param_name: str, ckpt: Checkpoint,
                       param: nn.Parameter | None = None) -> list[tuple[str, int]]:
    """The ``(checkpoint tensor name, shard id)`` pairs that make up parameter ``param_name``.

    A parameter stacked from many tensors (MoE experts) lists them itself as
    ``param.checkpoint_parts``: ``(name relative to its module, shard id)`` pairs.
    """
    parts = getattr(param, "checkpoint_parts", None)
    if parts is not None:
        module = param_name.rsplit(".", 1)[0]
        return [(f"{module}.{part}", shard_id) for part, shard_id in parts]
    mapping = getattr(model, "packed_modules_mapping", {})
    for packed in {p for p, _ in mapping.values()}:
        if f".{packed}." in param_name:
            return [(param_name.replace(f".{packed}.", f".{part}."), shard_id)
                    for part, (p, shard_id) in mapping.items() if p == packed]
    if param_name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False) and param_name not in ckpt:
        return [("model.embed_tokens.weight", 0)]
    return [(param_name, 0)]


def load_weights(model: nn.Module, ckpt: Checkpoint, progress: bool = True) -> int:
    """Load every parameter of ``model`` from ``ckpt``; layers with a weight format set pack
    theirs afterwards (``workers/layers/quantized.py``).

    Returns:
        bytes of weights held on this rank (float parameters plus packed weights).

    Raises:
        CheckpointError: a tensor is missing, has the wrong shape, or cannot be read.
    """
    from shardserve.workers.layers.quantized import process_weights_after_loading

    params = dict(model.named_parameters())
    for name, param in tqdm(params.items(), desc="loading weights", unit="tensor", file=sys.stderr,
                            disable=not progress, leave=False):
        loader = getattr(param, "weight_loader", default_weight_loader)
        for ckpt_name, shard_id in checkpoint_sources(model, name, ckpt, param):
            loader(param, ckpt.require(ckpt_name), shard_id)
    process_weights_after_loading(model)
    return sum(weight_bytes_by_format(model).values())


def build_meta_model(config, ckpt: Checkpoint, tensor_split: list[float] | None = None,
                     dtype: torch.dtype = torch.float32, keep_fp8: bool = False,
                     weight_format: WeightFormat | None = None) -> nn.Module:
    """This rank's model on the ``meta`` device, every parameter already in its final dtype and
    format; nothing is allocated and nothing read but the checkpoint's metadata.

    The model class for ``config`` is built under ``torch.device("meta")`` (its TP slice from the
    current TP group), then FP8 block-scaled layers switch to FP8 storage with their scales
    (:func:`workers.fp8.keep_fp8_weights`, when ``keep_fp8`` and the checkpoint is FP8) and, with a
    ``weight_format``, the layers that will be packed for the CPU kernels are marked
    (:func:`workers.layers.quantized.apply_weight_format`). :func:`weight_bytes_by_format` of the
    result is what the rank will hold after loading; ``workers/plan.py`` plans from it and
    :func:`build_model` materializes it.

    Args:
        config: the HF config (with serving switches).
        ckpt: the checkpoint (safetensors, GGUF, or ``workers.plan.ConfigOnlyCheckpoint``).
        tensor_split: relative per-rank shares (None = even).
        dtype: parameter dtype of the float weights.
        keep_fp8: keep FP8 block-scaled linear weights in FP8 (the GPU path).
        weight_format: keep / make weights packed for the CPU kernels (None: float weights).

    Raises:
        ValueError: an unsupported architecture or a split the model cannot take.
    """
    from shardserve.workers.fp8 import block_size_of, is_block_fp8, keep_fp8_weights
    from shardserve.workers.layers.quantized import apply_weight_format
    from shardserve.workers.models.registry import model_class

    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, tensor_split=tensor_split, dtype=dtype)
    if keep_fp8 and is_block_fp8(ckpt, config):
        keep_fp8_weights(model, ckpt, block_size_of(config))
    if weight_format is not None:
        apply_weight_format(model, weight_format, ckpt)
    return model


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of a model's weights by storage format: parameters by dtype name (``"bfloat16"``,
    ``"float8_e4m3fn"``, ...), packed weights as ``"int4"`` / ``"int8"`` and their dense copies
    (``--packed-dense-rows``) as ``"int4 dense copies"`` / ``"int8 dense copies"``. Works on the
    meta-device model (a weight planned to be packed counts its packed size) and on the loaded one (its packed
    weights); a tensor shared by two modules (a tied LM head) counts once. Buffers (RoPE tables)
    are not weights: :func:`buffer_bytes`."""
    out: dict[str, int] = {}

    def add(key: str, size: int) -> None:
        out[key] = out.get(key, 0) + size

    for param in model.parameters():   # deduplicated by identity
        kind = getattr(param, "packed_kind", None)
        if kind:
            add(kind, param.packed_nbytes)
            if param.dense_nbytes:
                add(f"{kind} dense copies", param.dense_nbytes)
        else:
            add(str(param.dtype).removeprefix("torch."), param.numel() * param.element_size())
    packed = {id(m.packed): m.packed for m in model.modules() if getattr(m, "packed", None) is not None}
    for weight in packed.values():
        if weight.dense is None:
            add(weight.kind, weight.nbytes)
        else:
            add(weight.kind, weight.nbytes - weight.dense.nbytes)
            add(f"{weight.kind} dense copies", weight.dense.nbytes)
    return out


def buffer_bytes(model: nn.Module) -> int:
    """Bytes of a model's buffers (RoPE tables), meta or not; shared ones counted once."""
    return sum(buf.numel() * buf.element_size() for buf in {id(b): b for b in model.buffers()}.values())


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate the meta-device model's parameters on ``device``, each once, at its final dtype and
    size, uninitialized (the loader fills every one), keeping their attributes (``weight_loader``,
    ``checkpoint_parts``); a parameter shared by two modules stays shared. Weights planned to be
    packed stay on the meta device (never allocated: the packed weight replaces them after
    loading). Meta buffers are computed on ``device`` by their module's ``init_buffers``.

    Raises:
        TypeError: a module has meta buffers and no ``init_buffers``.
    """
    fresh: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}   # id(old) -> (old kept alive, new)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta or getattr(param, "packed_kind", None):
                continue
            if id(param) not in fresh:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                fresh[id(param)] = (param, new)
            module._parameters[name] = fresh[id(param)][1]
        if any(buf is not None and buf.is_meta for buf in module._buffers.values()):
            if not hasattr(module, "init_buffers"):
                raise TypeError(f"{type(module).__name__} has meta buffers but no init_buffers(device)")
            module.init_buffers(device)


@torch.no_grad()
def build_model(config, ckpt: Checkpoint, tensor_split: list[float] | None = None,
                dtype: torch.dtype = torch.float32, progress: bool = True, device: torch.device | str = "cpu",
                keep_fp8: bool = False, before_load=None,
                weight_format: WeightFormat | None = None) -> tuple[nn.Module, int]:
    """Build this rank's model where and as it will live, then load its weights.

    The model is built on the ``meta`` device with every parameter's final dtype and format decided
    (:func:`build_meta_model`), ``before_load(meta_model, weight_bytes)`` may check the plan before
    anything is allocated, then each parameter is allocated once on ``device`` at its final size
    (:func:`materialize`: no bf16 copy of an FP8 weight, no float copy of a packed one) and filled
    from ``ckpt``. So the memory the rank allocates on ``device`` while loading is its final
    weight bytes; checkpoint reads and FP8 dequantization stage one tensor at a time on the host.

    Args:
        config: the HF config (with serving switches).
        ckpt: the checkpoint; FP8 block-scaled weights are dequantized on read, except those of
            the layers and experts :func:`workers.fp8.keep_fp8_weights` switches when ``keep_fp8``.
        tensor_split: relative per-rank shares (None = even).
        dtype: parameter dtype.
        device: where parameters and buffers live.
        keep_fp8: keep FP8 block-scaled linear weights in FP8 (the GPU path).
        before_load: optional ``callable(meta_model, weight_bytes)``; raises to stop.
        weight_format: keep / make weights packed for the CPU kernels (None: float weights;
            ``workers/layers/quantized.py``).

    Returns:
        ``(model in eval mode, weight bytes on this rank)``.
    """
    from shardserve.workers.fp8 import dequantizing_checkpoint

    model = build_meta_model(config, ckpt, tensor_split, dtype, keep_fp8, weight_format)
    if before_load is not None:
        before_load(model, sum(weight_bytes_by_format(model).values()))
    materialize(model, device)
    weight_bytes = load_weights(model, dequantizing_checkpoint(ckpt, config), progress)
    _return_freed_memory()
    return model.eval(), weight_bytes


def _return_freed_memory() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps freed heap pages resident
    otherwise: +250 MiB RSS seen for SmolLM2's 118 MiB of packed weights without this)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to do
        pass
