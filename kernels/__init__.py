"""Hot-path ops: each module holds a torch reference (``*_ref``, also the CPU path) and a Triton
kernel beside it in ``<module>_triton.py``. Call the public name (``rms_norm``,
``paged_attention``, ...): it dispatches by device, overridable with ``SHARDSERVE_KERNELS=torch|triton``.

Triton is imported only when a Triton path first runs, so importing ``kernels`` works without
Triton installed and ``TRITON_INTERPRET=1`` may be set any time before the first kernel call.
"""

from __future__ import annotations

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.norm import rms_norm
from shardserve.kernels.paged_attention import paged_attention, store_cache, store_kv, store_kv_and_attend
from shardserve.kernels.rotary import apply_rotary
from shardserve.kernels.activation import silu_and_mul
from shardserve.kernels.mla_attention import mla_attention
from shardserve.kernels.indexer import indexer_scores, indexer_topk, select_topk
from shardserve.kernels.fused_moe import fused_moe
from shardserve.kernels.hadamard import hadamard_transform
from shardserve.kernels.fp8_linear import fp8_block_linear
from shardserve.kernels.gated_delta import gated_delta_chunk, gated_delta_recurrent
from shardserve.kernels.causal_conv1d import causal_conv1d

__all__ = ["use_triton", "rms_norm", "paged_attention", "store_kv", "store_kv_and_attend", "store_cache", "apply_rotary",
           "silu_and_mul", "mla_attention", "indexer_scores", "indexer_topk", "select_topk", "fused_moe", "hadamard_transform",
           "fp8_block_linear", "gated_delta_chunk", "gated_delta_recurrent", "causal_conv1d"]
