"""DraftWorker: the MTP draft model with its own paged caches (a Ray actor on rank 0's device in the
cluster; a plain object beside the runner in the single-process engine).

Each drafting pass gets a :class:`DraftBatch`: for every request, the positions the target just
computed *and accepted*, the next token of each (``x_{t+1}``) and the row of the target's hidden
state ``h_t`` in the shared hidden buffer (``workers/draft_buffers.py``; or in a tensor passed
along in one process). The worker writes those MTP cache entries (the entry of position ``t`` goes
to the slot of ``t`` on the target's block table, so its latent and indexer caches mirror the
target's), and for requests that decode next it proposes ``num_drafts`` tokens by chaining: the
last entry's logits give draft 1; draft ``j + 1`` comes from one more MTP step at the next position
with draft ``j`` as its token and the previous MTP output ``o`` as its hidden state.

The chain stays on the device: each step's sampled tokens are the next step's input ids, the draft
distributions ``q`` of sampled requests go straight into the shared ``probs`` buffer (one row per
drafting request, read by rank 0's verification), and the pass reads its draft tokens back to the
host once, at the end.

Rollback needs no work here: entries written for drafts (chained positions) are stale as soon as
the target rejects them, and the next batch starts at the first unaccepted position and overwrites
them before any query can read them (every query only reads positions at or before its own). A
request the speculation policy does not draft for may skip passes (its entries are then missing
and read as whatever the slots hold: only its later drafts get worse, never the output).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from shardserve.workers.device import resolve_device, resolve_dtype
from shardserve.workers.draft_buffers import BufferSizes, DraftBuffers, buffer_layout
from shardserve.workers.forward_context import AttentionMetadata, forward_context
from shardserve.workers.messages import DraftBatch, DraftProposal, DraftResult
from shardserve.workers.model_runner import RequestState, allocate_caches, apply_request_diffs, cache_bytes
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.models.mtp import build_mtp_model
from shardserve.workers.rejection_sampler import draft_sample
from shardserve.workers.sampler import is_greedy
from shardserve.workers.step_inputs import DeviceStager, HostBatch, device_batch
from shardserve.workers.step_channel import StepHost
from shardserve.workers.torch_thread import on_torch_thread
from shardserve.workers.weight_reload import ReloadableRank, open_recorded

logger = logging.getLogger(__name__)


def draft_inputs(start_pos: list[int], num_tokens: list[int], input_ids: list[int], tables: list[list[int]],
                 block_size: int, stager: DeviceStager) -> tuple[torch.Tensor, AttentionMetadata]:
    """``input_ids`` and the attention metadata of ``num_tokens[i]`` query tokens of sequence ``i``
    at positions ``start_pos[i]..`` over block tables ``tables``, on the stager's device (the
    runner's layout, see :mod:`workers.step_inputs`)."""
    positions, slots, query_start, seq_lens = [], [], [0], []
    for start, count, table in zip(start_pos, num_tokens, tables):
        span = range(start, start + count)
        positions.extend(span)
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in span)
        query_start.append(query_start[-1] + count)
        seq_lens.append(start + count)
    width = max(len(t) for t in tables)
    host = HostBatch(list(input_ids), positions, slots, query_start, seq_lens, [t + [0] * (width - len(t)) for t in tables],
                     [], max(num_tokens), max(seq_lens))
    ids, meta, _ = device_batch(host, stager)
    return ids, meta


class DraftWorker(StepHost, ReloadableRank):
    """Owns the MTP module, its caches and the buffers shared with rank 0; proposes draft tokens
    (recovery and weight-reload calls come from :class:`ReloadableRank`).

    Args:
        num_threads: torch intra-op threads (the CPUs reserved for the draft).
        inline: run every call on the caller's thread (the single-process engine, whose thread does
            all torch work; see ``workers/torch_thread.py``).
    """

    step_method = "propose"

    def __init__(self, num_threads: int | None = None, inline: bool = False) -> None:
        if num_threads:
            torch.set_num_threads(max(1, num_threads))
        self.torch_inline = inline
        self.model, self.hf_config = None, None
        self.weight_record = None
        self.requests: dict[str, RequestState] = {}
        self.block_size = 0
        self.num_blocks = 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.generator = torch.Generator()
        self.stager = DeviceStager(self.device)
        self.buffers: DraftBuffers | None = None

    @on_torch_thread
    def load_weights(self, files: ModelFiles, hf_config, sizes: BufferSizes, block_size: int, dtype: str = "auto",
                     seed: int = 0, device: str = "auto") -> dict:
        """Load the MTP weights on ``device`` (resolved as a shard worker's, ``workers/device.py``) and
        allocate the buffers shared with rank 0 (before rank 0 profiles its memory on a GPU, so it
        sees them in use; the caches come with :meth:`allocate_caches`).

        Returns:
            ``{"weight_bytes", "bytes_per_block", "buffer_bytes", "pid", "fingerprint", "shapes"}``
            (``bytes_per_block``: what one cache block of ``block_size`` tokens costs the draft;
            fingerprint and shapes: :class:`workers.weight_reload.WeightRecord`).

        Raises:
            ValueError: the checkpoint has no MTP layer, or an impossible device.
        """
        self.device = torch.device(resolve_device(device))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, self.device.type)
        self.stager = DeviceStager(self.device)
        self.checkpoint = open_recorded(files.path)   # reads recorded: digests for weight reloads
        self.model, weight_bytes = build_mtp_model(hf_config, self.checkpoint, self.dtype, self.device)
        self.hf_config, self.weight_record = hf_config, self.checkpoint.observer.record
        self.weight_loads += 1
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.block_size = block_size
        self.buffers = DraftBuffers.allocate(buffer_layout(hf_config, *sizes, self.dtype), self.device)
        return {"weight_bytes": weight_bytes, "bytes_per_block": cache_bytes(self.model.attention_layers(), 1, block_size),
                "buffer_bytes": self.buffers.nbytes, "pid": os.getpid(),
                "fingerprint": self.weight_record.fingerprint(), "shapes": dict(self.weight_record.shapes)}

    @on_torch_thread
    def allocate_caches(self, num_blocks: int) -> int:
        """Allocate ``num_blocks`` cache blocks (the target's count: the caches share its block ids);
        returns their bytes."""
        self.num_blocks = num_blocks
        nbytes = allocate_caches(self.model.attention_layers(), num_blocks, self.block_size, self.device)
        logger.info("draft (MTP): weights on %s, caches %.1f MiB in %d blocks, shared buffers %.1f MiB", self.device,
                    nbytes / 2**20, num_blocks, self.buffers.nbytes / 2**20)
        return nbytes

    def load(self, files: ModelFiles, hf_config, sizes: BufferSizes, block_size: int, num_blocks: int,
             dtype: str = "auto", seed: int = 0, device: str = "auto") -> dict:
        """:meth:`load_weights` then :meth:`allocate_caches` (the single-process engine and tests)."""
        info = self.load_weights(files, hf_config, sizes, block_size, dtype, seed, device)
        return {**info, "cache_bytes": self.allocate_caches(num_blocks)}

    @on_torch_thread
    def share_buffers(self, fresh: bool = False) -> dict:
        """The shared buffers' handle for rank 0 (:meth:`DraftBuffers.attach`); ``fresh``: new buffers
        first (a new rank 0 cannot map the old ones once their name is gone)."""
        if fresh:
            self.buffers.release_name()
            self.buffers = DraftBuffers.allocate(self.buffers.layout, self.device)
        return self.buffers.handle()

    def release_buffer_name(self) -> None:
        """Rank 0 has attached the shared buffers: remove their file's name (CPU)."""
        if self.buffers is not None:
            self.buffers.release_name()

    def _forward(self, req_ids: list[str], start_pos: list[int], num_tokens: list[int], input_ids,
                 prev_hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward over packed entries (``input_ids``: host list, or ``[T]`` on the device);
        returns the block outputs ``o [T, hidden]``."""
        on_device = isinstance(input_ids, torch.Tensor)
        ids, meta = draft_inputs(start_pos, num_tokens, [0] * len(input_ids) if on_device else input_ids,
                                 [self.requests[r].block_ids for r in req_ids], self.block_size, self.stager)
        with forward_context(meta):
            return self.model(input_ids if on_device else ids, meta.positions, prev_hidden)

    def _hidden(self, batch: DraftBatch, num_entries: int) -> torch.Tensor:
        """The entries' ``h_t [T, hidden]`` in the draft's dtype, gathered from the shared buffer
        (or the tensor the batch carries) on the device."""
        source = batch.hidden_states if batch.hidden_states is not None else self.buffers.hidden
        assert len(batch.hidden_rows) == num_entries, f"{len(batch.hidden_rows)} hidden rows for {num_entries} entries"
        rows = torch.tensor(batch.hidden_rows, dtype=torch.int64).to(source.device)
        return source.index_select(0, rows).to(self.device, self.dtype)

    @on_torch_thread        # outside: inference mode is per thread, so it must be entered on the torch thread
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftResult:
        """Write the batch's MTP cache entries and propose drafts (see the module docstring).

        Returns:
            one :class:`DraftProposal` per request with ``num_drafts > 0``, in batch order, and the
            time spent here.
        """
        started = time.perf_counter()
        apply_request_diffs(self.requests, batch.finished_req_ids, batch.new_requests, batch.scheduled)
        scheduled = batch.scheduled
        if not scheduled:
            return DraftResult()
        lengths = [len(s.token_ids) for s in scheduled]
        out = self._forward([s.req_id for s in scheduled], [s.start_pos for s in scheduled], lengths,
                            [t for s in scheduled for t in s.token_ids], self._hidden(batch, sum(lengths)))
        drafting = [i for i, s in enumerate(scheduled) if s.num_drafts > 0]
        if not drafting:
            return DraftResult(seconds=time.perf_counter() - started)
        ends, total = [], 0
        for count in lengths:
            total += count
            ends.append(total - 1)
        tokens = self._chain(batch, drafting, out[torch.tensor([ends[i] for i in drafting], device=self.device)])
        proposals = []
        for row, i in enumerate(drafting):
            sched = scheduled[i]
            greedy = is_greedy(self.requests[sched.req_id].sampling)
            proposals.append(DraftProposal(sched.req_id, tokens[row][:sched.num_drafts], -1 if greedy else row))
        return DraftResult(proposals, time.perf_counter() - started)

    def _chain(self, batch: DraftBatch, drafting: list[int], hidden: torch.Tensor) -> list[list[int]]:
        """Chained drafting on the device for the requests ``drafting`` (indices into the batch),
        from the last entries' outputs ``hidden [N, hidden]``; ``q`` rows go to the shared buffer
        (request ``drafting[r]`` uses row ``r``). Returns the ``[N, depth]`` drafts, read back once."""
        scheduled = batch.scheduled
        depth = max(scheduled[i].num_drafts for i in drafting)
        assert len(drafting) <= self.buffers.probs.shape[0] and depth <= self.buffers.probs.shape[1], \
            f"{len(drafting)} x {depth} drafts exceed the q buffer {tuple(self.buffers.probs.shape[:2])}"
        drafts = torch.zeros(len(drafting), depth, dtype=torch.int64, device=self.device)
        active = list(range(len(drafting)))                       # rows still drafting at this depth
        tokens = None
        for step in range(depth):
            if step:
                keep = [pos for pos, row in enumerate(active) if scheduled[drafting[row]].num_drafts > step]
                if len(keep) < len(active):
                    index = torch.tensor(keep, device=self.device)
                    active, hidden, tokens = [active[pos] for pos in keep], hidden[index], tokens[index]
                reqs = [scheduled[drafting[row]] for row in active]
                # chained step: the position after the last entry + step - 1, token = previous draft, h = previous o
                hidden = self._forward([s.req_id for s in reqs], [s.start_pos + len(s.token_ids) + step - 1 for s in reqs],
                                       [1] * len(reqs), tokens, hidden)
            reqs = [scheduled[drafting[row]] for row in active]
            tokens, q = draft_sample(self.model.compute_logits(hidden), [self.requests[s.req_id].sampling for s in reqs],
                                     [s.output_index + step for s in reqs], self.generator)
            rows = torch.tensor(active, device=self.device)
            drafts[rows, step] = tokens
            if q is not None:
                self.buffers.probs[rows, step] = q
        return drafts.tolist()

    def _weights(self) -> DraftWorker:
        return self

    def shutdown(self) -> None:
        """Close the step channel; remove the shared buffers' name if rank 0 never attached them."""
        self.close_step_channel()
        self.release_buffer_name()
