"""Decode forwards replayed from captured CUDA graphs, one graph per padded batch size.

A decode step (every sequence computes one token) has fixed shapes once its batch is padded, so
its forward, all-reduces included (NCCL runs on torch's current stream, which is the capture
stream), is captured once per size in :func:`capture_sizes` and replayed (vLLM's and nano-vllm's
scheme). Prefill and mixed steps run eagerly. Graphs read fixed buffers: the step's integers are
uploaded into them (:class:`workers.step_inputs.DeviceStager`, one copy), the graph runs, and the
hidden states of the real rows are read from the graph's output buffer.

Fixed shapes and what they mean for the kernels:

- the block tables are ``[size, width]`` with ``width = ceil(max_model_len / block_size)`` and the
  attention kernels get ``max_seq_len = width * block_size`` (they mask by each row's real length);
- padded rows compute token 0 at position 0 of a one-token sequence whose only block is the
  runner's *scratch block* (one block past the coordinator's pool), so they write and read only it;
- hybrid models (Qwen3-Next): the recurrent states live in fixed per-slot buffers (the runner's
  state pool, ``workers/state_cache.py``), so a decode step reads and writes them at the slots in a
  fixed ``[size]`` buffer (vLLM's scheme for Mamba-like layers); padded rows use the pool's
  *scratch slot* (one past the slots requests get). The pool's bookkeeping (zeroing new slots,
  speculative rollback) runs eagerly before the replay.

Nothing in a captured forward may read back to the host or take a data-dependent shape
(``workers/sync_guard.py``); the replay stand-in runs the forward under that guard, so the CPU
tests fail where a CUDA capture would.

``backend="cuda"`` captures ``torch.cuda.CUDAGraph``s (warm-up on a side stream first, largest size
first so smaller graphs reuse the shared memory pool). ``backend="replay"`` is the CPU stand-in used
by the tests and ``benchmarks/gpu_check.sh --cpu-dry-run``: it runs the same function on the same
fixed buffers eagerly, so padding, buffer layout, size selection and output slicing are exercised
where no GPU is.
"""

from __future__ import annotations

import logging
import time

import torch

from collections.abc import Callable

from shardserve.workers.forward_context import AttentionMetadata, forward_context
from shardserve.workers.state_cache import SeqGroup, StateMetadata
from shardserve.workers.step_inputs import DeviceStager, HostBatch
from shardserve.workers.sync_guard import no_host_sync

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, ... up to the first power of two >= ``max_num_seqs``."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    """Captured decode forwards of one model.

    Args:
        model: the model (``forward(input_ids [T], positions [T]) -> hidden [T, hidden]`` inside a
            forward context); its caches must be allocated (graphs hold their addresses).
        device: the runner's device.
        max_num_seqs: largest decode batch to capture (rounded up to a power of two).
        max_model_len: longest sequence; sets the block-table width.
        block_size: tokens per block.
        scratch_block: a cache block no request owns (padded rows use it).
        backend: ``"cuda"`` (CUDA graphs) or ``"replay"`` (eager stand-in, any device, run under
            :func:`workers.sync_guard.no_host_sync`).
        scratch_state_slot: for models with recurrent layers, a state slot no request owns (padded
            rows use it); None for models without them.
    """

    def __init__(self, model, device: torch.device, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, backend: str, scratch_state_slot: int | None = None) -> None:
        assert backend in ("cuda", "replay"), f"unknown graph backend {backend!r}"
        assert backend == "replay" or device.type == "cuda", "CUDA graphs need a CUDA device"
        self.model, self.device, self.backend = model, device, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_state_slot = scratch_state_slot
        largest = self.sizes[-1]
        # Fixed inputs: `_incoming` holds ids, positions, slots, seq lens and (hybrid models) state
        # slots, one region of `largest` each (a smaller size uses the front of each), then the
        # step's block tables cut to the width it uses and the rows whose token rank 0 shares
        # (async scheduling); `_tables` is the graphs' full-width table. Columns past a row's
        # length keep stale ids: the kernels read blocks only below each row's length.
        self._regions = 4 + (scratch_state_slot is not None)
        self._incoming = torch.zeros((self._regions + 1) * largest + largest * self.width, dtype=torch.int64,
                                     device=device)
        self._tables = torch.zeros(largest, self.width, dtype=torch.int64, device=device)
        self._query_start = torch.arange(largest + 1, dtype=torch.int64, device=device)
        self._state_starts = torch.arange(largest + 1, dtype=torch.int32, device=device)   # one token each
        self._graphs: dict[int, object] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    # -- layout -------------------------------------------------------------------------------
    def _region(self, index: int, size: int) -> torch.Tensor:
        largest = self.sizes[-1]
        return self._incoming[index * largest:index * largest + size]

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        ids, pos, slots, lens = (self._region(i, size) for i in range(4))
        return ids, pos, slots, lens, self._tables[:size]

    def _forward(self, size: int) -> torch.Tensor:
        ids, pos, slots, lens, tables = self._views(size)
        meta = AttentionMetadata(slot_mapping=slots, positions=pos, query_start_loc=self._query_start[:size + 1],
                                 seq_lens=lens, block_tables=tables.to(torch.int32), max_query_len=1,
                                 max_seq_len=self.width * self.block_size)
        if self.scratch_state_slot is not None:   # every row one recurrent token at its slot
            cu_seqlens, state_slots = self._state_starts[:size + 1], self._region(4, size).to(torch.int32)
            meta.state = StateMetadata(cu_seqlens, state_slots, chunked=None,
                                       recurrent=SeqGroup(None, cu_seqlens, state_slots), keep=False)
        with forward_context(meta):
            return self.model(ids, pos)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The fixed input buffers and the captured outputs."""
        states = [("state_starts", self._state_starts)] if self.scratch_state_slot is not None else []
        return ([("incoming", self._incoming), ("tables", self._tables), ("query_start", self._query_start)]
                + states + [(f"output.{size}", out) for size, out in self._outputs.items()])

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` decodes runs at (None: too large, run eagerly)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def _fill_padding(self, size: int) -> None:
        """Every row of ``size`` a valid padded row (before warm-up and capture)."""
        ids, pos, slots, lens, tables = self._views(size)
        ids.zero_()
        pos.zero_()
        slots.fill_(self.scratch_block * self.block_size)
        lens.fill_(1)
        tables.fill_(self.scratch_block)
        if self.scratch_state_slot is not None:
            self._region(4, size).fill_(self.scratch_state_slot)

    # -- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (largest first); logs the time and the graph memory taken."""
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device) if self.backend == "cuda" else 0
        for size in reversed(self.sizes):
            self._fill_padding(size)
            if self.backend == "replay":
                self._graphs[size] = None
                continue
            self._capture_cuda(size)
        if self.backend == "cuda":
            torch.cuda.synchronize(self.device)
        used = (torch.cuda.memory_allocated(self.device) - before) if self.backend == "cuda" else 0
        logger.info("decode graphs (%s): %d sizes up to %d in %.1f s, %.1f MiB", self.backend, len(self.sizes),
                    self.sizes[-1], time.perf_counter() - start, used / 2**20)

    def _capture_cuda(self, size: int) -> None:
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels, lazy allocations
        # happen) so the capture records only the steady-state launches (torch.cuda.graph docs).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self._outputs[size] = self._forward(size)
        self._graphs[size] = graph

    # -- replay -------------------------------------------------------------------------------
    def run(self, host: HostBatch, stager: DeviceStager, state_slots: list[int] | None = None,
            share_tokens: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Run the decode step ``host`` (``host.is_decode``, at most the largest size) from its graph.

        Args:
            host: the step's inputs.
            stager: uploads them into the fixed buffers (one copy).
            state_slots: ``[num_seqs]`` recurrent-state slots (hybrid models; see
                :meth:`workers.state_cache.StateCache.begin_decode`).
            share_tokens: called as ``share_tokens(input_ids, rows)`` on the uploaded ids and the
                device rows ``host.placeholder_rows`` before the replay (async scheduling at TP > 1).

        Returns:
            ``[num_seqs, hidden]`` hidden states of the real rows (a view of the graph's output on
            CUDA: valid until the next replay).
        """
        num = host.num_seqs
        size = self.padded_size(num)
        assert size is not None and host.is_decode, f"{num} sequences, decode={host.is_decode}: not graphable"
        assert len(host.block_tables[0]) <= self.width, \
            f"block table of {len(host.block_tables[0])} blocks exceeds the graphs' {self.width}"
        assert (state_slots is not None) == (self.scratch_state_slot is not None), "state slots iff recurrent layers"
        largest, used = self.sizes[-1], len(host.block_tables[0])
        extra = largest - num
        flat = (host.input_ids + [0] * extra + host.positions + [0] * extra
                + host.slot_mapping + [self.scratch_block * self.block_size] * extra + host.seq_lens + [1] * extra)
        if state_slots is not None:
            flat += state_slots + [self.scratch_state_slot] * extra
        flat += ([b for t in host.block_tables for b in t] + ([self.scratch_block] + [0] * (used - 1)) * (size - num)
                 + host.placeholder_rows)
        stager.upload(flat, self._incoming)
        tables_at = self._regions * largest
        self._tables[:size, :used].copy_(self._incoming[tables_at:tables_at + size * used].view(size, used))
        if share_tokens is not None and host.placeholder_rows:
            rows_at = tables_at + size * used
            share_tokens(self._region(0, num), self._incoming[rows_at:rows_at + len(host.placeholder_rows)])
        if self.backend == "replay":
            with no_host_sync("a decode graph (the replay stand-in of a CUDA graph)"):
                return self._forward(size)[:num]
        self._graphs[size].replay()
        return self._outputs[size][:num]
