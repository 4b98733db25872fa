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


@torch.no_grad()
def build_model(config, ckpt: Checkpoint, tensor_split: list[float] | None = None,
                dtype: torch.dtype = torch.float32, progress: bool = True,
                weight_format: WeightFormat | None = None) -> tuple[nn.Module, int]:
    """Construct the model class for ``config`` and load this rank's weights.

    Args:
        weight_format: keep / make weights packed for the CPU kernels (None: float weights).

    Returns:
        ``(model in eval mode, weight bytes on this rank)``.
    """
    from shardserve.workers.fp8 import dequantizing_checkpoint
    from shardserve.workers.layers.quantized import apply_weight_format
    from shardserve.workers.models.registry import model_class

    ckpt = dequantizing_checkpoint(ckpt, config)  # FP8 block-scaled weights read as float32
    model = model_class(config)(config, tensor_split=tensor_split, dtype=dtype)
    if weight_format is not None:
        apply_weight_format(model, weight_format)
    weight_bytes = load_weights(model, ckpt, progress)
    del ckpt
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
