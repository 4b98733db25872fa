"""Catch host synchronizations and data-dependent shapes in code that CUDA graphs capture.

A captured decode step must not read anything back to the host (the capture fails with "operation
not permitted when stream is capturing"; run eagerly, each read stalls the launch queue) and every
tensor in it must have a shape known before it runs (a replay reuses the captured shapes).
:func:`no_host_sync` fails on the ops that break either rule, on any device, so the CPU tests and
``benchmarks/gpu_check.sh --cpu-dry-run`` prove what a GPU capture needs (the CPU stand-in of the
graphs, :class:`workers.cuda_graphs.DecodeGraphs` with ``backend="replay"``, runs under it):

- host reads: ``.item()`` / ``int()`` / ``float()`` / ``bool()`` of a tensor (``aten._local_scalar_dense``,
  ``aten.is_nonzero``, ``aten.equal``), ``.tolist()``, ``.cpu()``, ``.numpy()``, a copy to the CPU;
- data-dependent shapes: ``nonzero`` / ``torch.where(cond)`` / ``argwhere``, boolean-mask indexing
  (``x[mask]``, ``x[mask] = y``), ``masked_select``, ``unique``, ``bincount`` (CUDA reads its
  min/max back), ``repeat_interleave`` with tensor repeats and no ``output_size``;
- host data put on the device inside the step (``torch.tensor(list)``, or a Python number written
  into one element, ``x[i] = 0``: host-to-device copies from pageable memory, which a CUDA capture
  refuses; ``x[i:j] = 0`` and ``fill_`` are device fills and pass).

Triton kernels run under the interpreter on CPU (``TRITON_INTERPRET=1``) copy their arguments to
host buffers; the guard is suspended inside a launch (the launch itself is what a GPU captures).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """An op that a captured step cannot contain ran under :func:`no_host_sync`."""


# op packet -> why it cannot be captured
_FORBIDDEN = {
    aten._local_scalar_dense: "reads a tensor's value on the host (.item(), int(), float(), bool())",
    aten.item: "reads a tensor's value on the host (.item(), int(), float())",
    aten.is_nonzero: "reads a tensor's truth value on the host (bool(tensor), `if tensor:`)",
    aten.equal: "torch.equal returns a host bool",
    aten.nonzero: "data-dependent shape (nonzero, torch.where(cond), argwhere)",
    aten.argwhere: "data-dependent shape (argwhere)",
    aten.masked_select: "data-dependent shape (masked_select, x[mask])",
    aten.bincount: "bincount reads min/max back to the host on CUDA",
    aten._unique: "data-dependent shape (unique)",
    aten._unique2: "data-dependent shape (unique)",
    aten.unique_dim: "data-dependent shape (unique)",
    aten.unique_consecutive: "data-dependent shape (unique_consecutive)",
    aten.unique_dim_consecutive: "data-dependent shape (unique_consecutive)",
}
_BOOL_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _why(func, args, kwargs) -> str | None:
    packet = func.overloadpacket
    if packet in _FORBIDDEN:
        return _FORBIDDEN[packet]
    if packet is aten.where and len(args) == 1:   # torch.where(cond) (not decomposed in inference mode)
        return "data-dependent shape (torch.where(cond) is nonzero)"
    if packet is aten.lift_fresh and args[0].dim() > 0:   # 0-dim: a Python number; its copy_ is checked by the mode
        return "host data copied to the device inside the step (torch.tensor(list))"
    if packet in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "boolean-mask indexing (data-dependent shape): use torch.where / masked_fill / scatter"
    if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor):
        repeats_tensor = args[0].dtype != torch.bool and (len(args) == 1 or isinstance(args[1], torch.Tensor))
        if repeats_tensor and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
            return "repeat_interleave with tensor repeats and no output_size (data-dependent shape)"
    if packet in (aten._to_copy, aten.copy_) and args and isinstance(args[0], torch.Tensor):
        src = args[1] if packet is aten.copy_ else args[0]
        dst_device = args[0].device if packet is aten.copy_ else kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_device is not None \
                and torch.device(dst_device).type == "cpu":
            return "copies a device tensor to the host"
    return None


class _NoHostSyncMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: False keeps __torch_dispatch__ unwrapped: wrapping it imports torch._dynamo on the
        # first op (seconds per process) and costs a wrapper call per op; the guard compiles nothing.
        return False

    def __init__(self, where: str, uploads: bool) -> None:
        super().__init__()
        self.where, self.uploads = where, uploads
        self._host_scalars: weakref.WeakSet = weakref.WeakSet()   # 0-dim tensors made from Python numbers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why, upload = _why(func, args, kwargs), func.overloadpacket is aten.lift_fresh
        if why is None and func.overloadpacket is aten.copy_ and len(args) > 1 and args[1] in self._host_scalars:
            why, upload = ("copies a Python number into a tensor element (`x[i] = 0`: a host-to-device copy from "
                           "pageable memory, refused by a CUDA capture): use x[i:i + 1].fill_(v) or "
                           "x.narrow(...).zero_()"), True
        if why is not None and not (self.uploads and upload):
            raise HostSyncError(f"{func} in {self.where}: {why}")
        out = func(*args, **kwargs)
        if func.overloadpacket is aten.lift_fresh and args[0].dim() == 0:
            self._host_scalars.add(out)
        return out


_depth = 0   # > 0 while a guarded region runs (the patched Tensor methods check it)


def guarded() -> bool:
    """True inside :func:`no_host_sync` (code that may choose a sync-free form asks this, e.g. the
    MoE reference on CPU, which otherwise reads its per-expert counts back)."""
    return _depth > 0


def _host_read(name: str, method):
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if _depth > 0:
            raise HostSyncError(f"Tensor.{name}() in a captured step reads the tensor on the host")
        return method(self, *args, **kwargs)

    checked.__wrapped_host_read__ = method
    return checked


def _suspended(call):
    """``call`` with the guard off (a Triton interpreter launch copies tensors to host buffers)."""

    @functools.wraps(call)
    def run(*args, **kwargs):
        global _depth
        if _depth == 0:
            return call(*args, **kwargs)
        saved, _depth = _depth, 0
        try:
            with _disable_current_modes():
                return call(*args, **kwargs)
        finally:
            _depth = saved

    run.__suspends_guard__ = True
    return run


def _patch_once() -> None:
    for name in ("tolist", "cpu", "numpy"):
        method = getattr(torch.Tensor, name)
        if not hasattr(method, "__wrapped_host_read__"):
            setattr(torch.Tensor, name, _host_read(name, method))
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return   # no interpreted launches (and importing Triton now would fix its mode too early)
    from triton.runtime import interpreter
    if not getattr(interpreter.GridExecutor.__call__, "__suspends_guard__", False):
        interpreter.GridExecutor.__call__ = _suspended(interpreter.GridExecutor.__call__)


@contextlib.contextmanager
def no_host_sync(where: str = "a captured decode step", uploads: bool = False) -> Iterator[None]:
    """Within the block, raise :class:`HostSyncError` on any op a CUDA graph capture cannot hold
    (see the module docstring); ``where`` names the region in the message. ``uploads=True`` allows
    host data copied to the device (``torch.tensor(list)``: code outside a graph that must not
    *read* the device, like the sampler).

    Raises:
        HostSyncError: such an op ran (the message names it and why).
    """
    global _depth
    _patch_once()
    _depth += 1
    try:
        with _NoHostSyncMode(where, uploads):
            yield
    finally:
        _depth -= 1
