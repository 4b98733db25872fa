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
    from shardserve.workers.layers.quantized import packed_bytes, process_weights_after_loading

    params = dict(model.named_parameters())
    for name, param in tqdm(params.items(), desc="loading weights", unit="tensor", file=sys.stderr,
                            disable=not progress, leave=False):
        loader = getattr(param, "weight_loader", default_weight_loader)
        for ckpt_name, shard_id in checkpoint_sources(model, name, ckpt, param):
            loader(param, ckpt.require(ckpt_name), shard_id)
    process_weights_after_loading(model)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed_bytes(model)


def _construct(config, tensor_split: list[float] | None, dtype: torch.dtype, device: torch.device | str,
               raw: Checkpoint, keep_fp8: bool) -> nn.Module:
    """The model class for ``config``, its parameters created on ``device`` (not loaded)."""
    from shardserve.workers.fp8 import block_size_of, keep_fp8_weights
    from shardserve.workers.models.registry import model_class

    with torch.device(device):
        model = model_class(config)(config, tensor_split=tensor_split, dtype=dtype)
    if keep_fp8:
        keep_fp8_weights(model, raw, block_size_of(config))
    return model


def module_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (shared tensors counted once; meta tensors too)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def build_model(config, ckpt: Checkpoint, tensor_split: list[float] | None = None,
                dtype: torch.dtype = torch.float32, progress: bool = True, device: torch.device | str = "cpu",
                keep_fp8: bool = False, before_load=None,
                weight_format: WeightFormat | None = None) -> tuple[nn.Module, int]:
    """Construct the model class for ``config`` on ``device`` and load this rank's weights.

    The model is first built on the ``meta`` device (no memory) so ``before_load(meta_model,
    weight_bytes)`` can check that this rank's weights fit before any is read; then it is built
    on ``device`` directly (no host copy of the weights) and filled from ``ckpt``.

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
    from shardserve.workers.fp8 import Fp8DequantCheckpoint, dequantizing_checkpoint
    from shardserve.workers.layers.quantized import apply_weight_format

    raw = ckpt
    ckpt = dequantizing_checkpoint(raw, config)  # FP8 block-scaled weights read as float32
    keep_fp8 = keep_fp8 and isinstance(ckpt, Fp8DequantCheckpoint)
    if before_load is not None:
        meta = _construct(config, tensor_split, dtype, "meta", raw, keep_fp8)
        before_load(meta, module_bytes(meta))
    model = _construct(config, tensor_split, dtype, device, raw, keep_fp8)
    if weight_format is not None:
        apply_weight_format(model, weight_format)
    weight_bytes = load_weights(model, ckpt, progress)
    del ckpt, raw
    _return_freed_memory()
    return model.to(device).eval(), weight_bytes   # .to: buffers made on the CPU (RoPE tables)


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
