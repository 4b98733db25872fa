"""Count the bytes of the storages torch ops create (CPU has no allocator statistics).

:class:`StorageTracker` is a ``TorchDispatchMode``: every tensor an op returns whose storage it has
not seen is counted while that storage lives (a ``weakref.finalize`` on the storage object: torch
keeps one Python object per storage), so ``peak`` is the largest sum of live bytes created while
the mode was active. What it cannot see: memory an op allocates and frees inside itself (a sort's
or SDPA's workspace), and tensors made outside the dispatcher (``torch.frombuffer`` over an mmap,
as the CPU KV caches are). Allocations made while a frame of a file named in ``staging`` is on the
Python stack are counted apart, as ``staging_peak`` (the checkpoint readers: on a GPU rank they
stage on the host).
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created by torch ops while active.

    Args:
        staging: path fragments of source files whose allocations count as staging, not device.
    """

    def __init__(self, staging: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.staging = staging
        self.live = self.peak = 0
        self.staging_live = self.staging_peak = 0
        self._seen: set[int] = set()

    def _is_staging(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if any(part in frame.f_code.co_filename for part in self.staging):
                return True
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self._seen or key in inputs:   # a view or an in-place result
                continue
            self._seen.add(key)
            staged = bool(self.staging) and self._is_staging()
            self._add(size, staged)
            weakref.finalize(storage, self._free, key, size, staged)
        return out

    def _add(self, size: int, staged: bool) -> None:
        if staged:
            self.staging_live += size
            self.staging_peak = max(self.staging_peak, self.staging_live)
        else:
            self.live += size
            self.peak = max(self.peak, self.live)

    def _free(self, key: int, size: int, staged: bool) -> None:
        self._seen.discard(key)
        if staged:
            self.staging_live -= size
        else:
            self.live -= size
