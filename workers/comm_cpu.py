"""CPU collectives: torch.distributed gloo, and a shared-memory all-reduce for ranks on one node.

gloo on loopback costs 1.4-2.0 ms per call here even for a few hundred floats (DESIGN.md); with
two all-reduces per layer that dominates a CPU decode step. The shared-memory group instead has
each rank copy its tensor into its own slot of a shared segment, raise a per-rank sequence flag,
spin until every flag has reached the same call number, and sum the slots in rank order (so every
rank gets bitwise the same sum). Two slot sets alternate between calls: a rank can only start
call k+2 after every rank started call k+1, i.e. finished reading call k.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from shardserve.workers.distributed import TensorParallelGroup

_FLAG_STRIDE = 8          # int64s between flags: one 64-byte cache line each
_SPIN_BEFORE_YIELD = 200  # polls before giving the core away (2 ranks may share 2 cores with others)
_CLOSE_WAIT_S = 30.0      # how long close() waits for a collective in progress on another thread

logger = logging.getLogger(__name__)


class GlooGroup(TensorParallelGroup):
    """TP group over ``torch.distributed`` gloo (rendezvous ``tcp://host:port``)."""

    def __init__(self, tp_rank: int, tp_size: int, init_method: str, timeout_s: float = 300.0) -> None:
        super().__init__(tp_rank, tp_size)
        import datetime

        dist.init_process_group("gloo", init_method=init_method, rank=tp_rank, world_size=tp_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.all_reduce(tensor)
        return tensor

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor)
        return parts

    def _reduce_scatter_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        # gloo has no reduce_scatter: all-reduce the whole buffer, keep this rank's part
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor[self.tp_rank]

    def close(self) -> None:
        """Destroy the process group, then collect garbage. Without the collection a rank that had
        run a prefill aborted at interpreter exit ("terminate called without an active exception",
        SIGABRT) in 13 of 32 two-rank runs; with it, 0 of 32. Presumably objects of the forward in
        reference cycles were freed after gloo's teardown (not proven)."""
        if dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()


def shm_segment_bytes(tp_size: int, max_floats: int) -> int:
    """Size of the segment :class:`SharedMemoryGroup` needs: flags + abort word + 2 slot sets."""
    return _header_bytes(tp_size) + 2 * tp_size * max_floats * 4


def _header_bytes(tp_size: int) -> int:
    return (tp_size + 1) * _FLAG_STRIDE * 8


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to the coordinator's segment without taking ownership of it.

    NOTE: before Python 3.13 (``track=False``) attaching registers the segment with this
    process's resource tracker, which unlinks it when this process exits; the coordinator owns it.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class SharedMemoryGroup(TensorParallelGroup):
    """All-reduce / all-gather through a POSIX shared-memory segment (float32 payloads).

    Args:
        tp_rank, tp_size: this rank.
        name: the segment, created by the coordinator with :func:`shm_segment_bytes` bytes.
        max_floats: capacity of one slot (elements of the largest tensor exchanged).
        timeout_s: give up waiting for a peer after this long (it died or is stuck).

    Raises (from collectives):
        RuntimeError: the coordinator raised the abort word, a peer did not arrive in time, or the
            group is closed.

    Every collective holds the group's lock while it reads the segment, and :meth:`close` takes it
    before unmapping: a rank leaves its group from another thread than its step's (the step may be
    stuck on a dead peer), and numpy does not pin a buffer it views (``SharedMemory.close`` unmaps
    under live views), so without the lock a step still summing the slots read unmapped memory
    (a SIGSEGV in ``all_reduce`` when the draft worker was killed mid-step).
    """

    def __init__(self, tp_rank: int, tp_size: int, name: str, max_floats: int, timeout_s: float = 300.0) -> None:
        super().__init__(tp_rank, tp_size)
        self._shm = _attach(name)
        header = _header_bytes(tp_size)
        self._flags = np.ndarray(((tp_size + 1) * _FLAG_STRIDE,), np.int64, buffer=self._shm.buf)
        data = np.ndarray((2, tp_size, max_floats), np.float32, buffer=self._shm.buf, offset=header)
        self._slots = torch.from_numpy(data)
        self.max_floats, self.timeout_s = max_floats, timeout_s
        self._call = 0
        self._in_use = threading.Lock()

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        num = tensor.numel()
        slots = self._publish(tensor)
        return [slots[r, :num].view(tensor.shape) for r in range(self.tp_size)]

    def _all_to_all(self, send: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Each rank publishes its rows for every destination; each reads only the rows meant for
        it from every slot (float32 payloads)."""
        width = math.prod(send.shape[1:])
        with self._in_use:
            slots = self._publish(send.float())
            me, parts = self.tp_rank, []
            for source, row in enumerate(counts):
                start = sum(row[:me]) * width
                parts.append(slots[source, start:start + row[me] * width].view(row[me], *send.shape[1:]))
            return torch.cat(parts).to(send.dtype)

    def _publish(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into this rank's slot, raise its flag, wait until every rank has;
        returns the slot set ``[tp_size, max_floats]`` (valid until the call after next)."""
        num = tensor.numel()
        assert num <= self.max_floats, f"collective of {num} floats exceeds the {self.max_floats}-float slot"
        if self._shm is None:
            raise RuntimeError("shared-memory collective on a closed group")
        self._call += 1
        slots = self._slots[self._call % 2]
        slots[self.tp_rank, :num].copy_(tensor.reshape(-1))
        self._flags[self.tp_rank * _FLAG_STRIDE] = self._call  # publish after the copy (x86 keeps store order)
        peers = self._flags[: self.tp_size * _FLAG_STRIDE: _FLAG_STRIDE]
        abort = self.tp_size * _FLAG_STRIDE
        polls, deadline = 0, time.monotonic() + self.timeout_s
        while peers.min() < self._call:
            if self._flags[abort]:
                raise RuntimeError("shared-memory collective aborted by the coordinator")
            polls += 1
            if polls % _SPIN_BEFORE_YIELD == 0:
                os.sched_yield()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.tp_rank}: peers {peers.tolist()} did not reach call "
                                       f"{self._call} within {self.timeout_s} s")
        return slots

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        with self._in_use:
            parts = self._exchange(tensor.float())
            out = parts[0].clone()
            for part in parts[1:]:
                out += part  # rank order on every rank: bitwise-identical sums
        return out.to(tensor.dtype)

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        with self._in_use:
            return [part.clone().to(tensor.dtype) for part in self._exchange(tensor.float())]

    def _reduce_scatter_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank publishes its whole ``[tp_size, ...]`` buffer; each sums only its own part,
        in rank order (1/tp_size of an all-reduce's additions)."""
        with self._in_use:
            parts = self._exchange(tensor.float())
            out = parts[0][self.tp_rank].clone()
            for part in parts[1:]:
                out += part[self.tp_rank]
        return out.to(tensor.dtype)

    def close(self, timeout_s: float = _CLOSE_WAIT_S) -> None:
        """Unmap the segment once no collective reads it; from any thread. A collective stuck on a
        dead peer ends when the coordinator raises the abort word; if one is still running after
        ``timeout_s`` seconds, the mapping is left to the process's exit (logged). Idempotent."""
        if not self._in_use.acquire(timeout=timeout_s):
            logger.warning("rank %d: a shared-memory collective still runs after %.0f s; its segment stays "
                           "mapped until this process exits", self.tp_rank, timeout_s)
            return
        try:
            if self._shm is not None:
                del self._flags, self._slots
                self._shm.close()
                self._shm = None
        finally:
            self._in_use.release()


class SharedMemorySegment:
    """The coordinator's side of a :class:`SharedMemoryGroup`: creates, aborts and unlinks it."""

    def __init__(self, tp_size: int, max_floats: int) -> None:
        self.tp_size, self.max_floats = tp_size, max_floats
        self.shm = shared_memory.SharedMemory(create=True, size=shm_segment_bytes(tp_size, max_floats))
        self.shm.buf[:_header_bytes(tp_size)] = bytes(_header_bytes(tp_size))
        self.name = self.shm.name

    def abort(self) -> None:
        """Make every rank spinning in a collective raise instead of waiting forever."""
        flags = np.ndarray(((self.tp_size + 1) * _FLAG_STRIDE,), np.int64, buffer=self.shm.buf)
        flags[self.tp_size * _FLAG_STRIDE] = 1
        del flags

    def unlink(self) -> None:
        """Remove the segment's name once every rank has attached. The memory stays mapped in each
        process until it exits, but nothing is left in ``/dev/shm`` however the processes end
        (``ray stop``, SIGKILL, a crash), since nothing names it any more. Idempotent."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.shm.close()
        self.unlink()
