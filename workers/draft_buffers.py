"""Buffers rank 0 and the MTP draft worker share, so no step moves activations through Ray.

Two preallocated tensors on the draft worker's device (which is rank 0's: the draft actor shares
rank 0's placement-group bundle, and so its GPU or its node):

- ``hidden [max_tokens, hidden_size]`` (the target's dtype): rank 0 writes the final hidden states
  of every token a step computed (when the plan asks, ``plan.return_hidden``); the draft reads
  the rows of the entries it adds to its cache (``DraftBatch.hidden_rows``).
- ``probs [max_rows, max_drafts, vocab]`` float32: the draft writes the distribution ``q`` of each
  sampled request's drafts into one row; rank 0's verification reads the rows its plan names
  (``ScheduledRequest.draft_probs_row``). Greedy requests use no row.

Both live in one allocation, exchanged once at start-up: on CPU a file in ``/dev/shm`` mapped
shared by both processes (its name is removed once rank 0 has mapped it, so nothing is left
behind however the processes end); on CUDA the allocation's IPC handle (``torch.multiprocessing``'s
``reduce_tensor``), opened by rank 0 on the same GPU. In one process (the single-process engine)
the runner and the draft worker simply hold the same object.

NOTE: no locks. The engine loop orders every access: rank 0 writes ``hidden`` during step ``N`` and
reads ``probs`` during step ``N + 1``; the draft reads ``hidden`` and writes ``probs`` between them.
Each side's writes are complete when its call returns (its result has been read back to the host).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import torch

_ALIGN = 256   # bytes: every tensor starts on a cache-line / CUDA-alignment boundary


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Shapes and dtypes of the shared tensors (picklable; both sides build views from it)."""

    max_tokens: int           # rows of ``hidden``: the largest step (``--max-num-batched-tokens``)
    hidden_size: int
    hidden_dtype: str         # e.g. "float32", "bfloat16": the target's activations
    max_rows: int             # rows of ``probs``: the largest drafting batch (``--max-num-seqs``)
    max_drafts: int           # ``--speculative-tokens``
    vocab: int

    @property
    def hidden_bytes(self) -> int:
        return self.max_tokens * self.hidden_size * getattr(torch, self.hidden_dtype).itemsize

    @property
    def probs_bytes(self) -> int:
        return self.max_rows * self.max_drafts * self.vocab * 4

    @property
    def nbytes(self) -> int:
        """Bytes of the whole allocation."""
        return _aligned(self.hidden_bytes) + _aligned(self.probs_bytes)


class DraftBuffers:
    """The shared ``hidden`` and ``probs`` tensors (see the module docstring).

    Use :meth:`allocate` on the draft worker, :meth:`handle` to describe them, and
    :meth:`attach` on rank 0 (another process on the same node and device).
    """

    def __init__(self, base: torch.Tensor, layout: BufferLayout, path: str | None = None) -> None:
        self.base, self.layout, self._path = base, layout, path
        hidden_end = layout.hidden_bytes
        probs_start = _aligned(hidden_end)
        self.hidden = base[:hidden_end].view(getattr(torch, layout.hidden_dtype)).view(layout.max_tokens,
                                                                                       layout.hidden_size)
        self.probs = base[probs_start:probs_start + layout.probs_bytes].view(torch.float32).view(
            layout.max_rows, layout.max_drafts, layout.vocab)

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @classmethod
    def allocate(cls, layout: BufferLayout, device: torch.device | str) -> DraftBuffers:
        """Zero-filled buffers on ``device`` (CPU: in a shared file another process can map)."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls(torch.zeros(layout.nbytes, dtype=torch.uint8, device=device), layout)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"shardserve-draft-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        base = torch.from_file(path, shared=True, size=max(1, layout.nbytes), dtype=torch.uint8)
        return cls(base, layout, path)

    def handle(self) -> dict:
        """A picklable description :meth:`attach` opens in another process (once)."""
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(self.base)
            return {"layout": self.layout, "cuda": (rebuild, args)}
        return {"layout": self.layout, "path": self._path}

    @classmethod
    def attach(cls, handle: dict) -> DraftBuffers:
        """Map the buffers of :meth:`handle` (CUDA: on this process's current device, which must be
        the same GPU as the owner's).

        Raises:
            FileNotFoundError: the owner already removed the CPU file's name (attach before
                :meth:`release_name`).
        """
        layout = handle["layout"]
        if "cuda" in handle:
            rebuild, args = handle["cuda"]
            args = list(args)
            args[6] = torch.cuda.current_device()   # storage_device: the same GPU under this process's numbering
            return cls(rebuild(*args), layout)
        if not os.path.exists(handle["path"]):
            raise FileNotFoundError(f"draft buffers {handle['path']} are gone (attach before release_name)")
        return cls(torch.from_file(handle["path"], shared=True, size=max(1, layout.nbytes), dtype=torch.uint8), layout)

    def release_name(self) -> None:
        """Remove the CPU file's name (its memory stays mapped in every process that attached).
        Idempotent; nothing to do on CUDA."""
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


class BufferSizes(NamedTuple):
    """What the buffers must hold: a step's tokens, a step's drafting requests, drafts each."""

    max_tokens: int           # --max-num-batched-tokens
    max_rows: int             # --max-num-seqs
    max_drafts: int           # --speculative-tokens


def buffer_layout(hf_config, max_tokens: int, max_rows: int, max_drafts: int, hidden_dtype: torch.dtype) -> BufferLayout:
    """The layout for a model (``hidden_size``, ``vocab_size`` of its HF config); ``hidden_dtype`` is
    the draft's (and so the target's) activation dtype."""
    return BufferLayout(max(1, max_tokens), hf_config.hidden_size, str(hidden_dtype).removeprefix("torch."),
                        max(1, max_rows), max(1, max_drafts), hf_config.vocab_size)

