"""Hot-path ops: each module holds a torch reference (``*_ref``, also the CPU path) and, where
written, a Triton kernel. Call the public name (``rms_norm``, ``paged_attention``, ...): it
dispatches by device, overridable with ``SHARDSERVE_KERNELS=torch|triton``.
"""

from kernels.dispatch import use_triton
from kernels.norm import rms_norm
from kernels.paged_attention import paged_attention, store_kv
from kernels.rotary import apply_rotary
from kernels.activation import silu_and_mul

__all__ = ["use_triton", "rms_norm", "paged_attention", "store_kv", "apply_rotary", "silu_and_mul"]
