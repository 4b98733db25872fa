"""Choose between a Triton kernel and its torch reference.

Each public op in ``kernels/`` asks :func:`use_triton` about its first tensor argument and then
imports its ``*_triton`` module on first use; the ``*_ref`` functions never need Triton.
"""

from __future__ import annotations

import os

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should run for ``tensor``.

    ``SHARDSERVE_KERNELS=torch`` forces the reference, ``=triton`` forces the kernel (on CPU
    only meaningful under ``TRITON_INTERPRET=1``); unset: Triton on CUDA tensors only. While
    ``torch.compile`` traces (``workers/compilation.py``) always the reference: Inductor generates
    its own fused kernels from it; opaque calls run outside the trace and dispatch as usual.

    Raises:
        ValueError: ``SHARDSERVE_KERNELS`` has another value.
    """
    if torch.compiler.is_compiling():
        return False   # traced by torch.compile: the torch reference, which Inductor fuses and generates
    mode = os.environ.get("SHARDSERVE_KERNELS", "").lower()
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    if mode:
        raise ValueError(f"SHARDSERVE_KERNELS={mode!r}: expected 'torch' or 'triton'")
    return tensor.is_cuda
