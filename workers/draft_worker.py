"""DraftWorker: the MTP draft model with its own paged caches (a Ray actor in the cluster; a plain
object in the single-process engine).

Each engine step the coordinator sends a :class:`DraftBatch`: for every request, the positions
the target just computed *and accepted*, the next token of each (``x_{t+1}``) and the target's
hidden state ``h_t``. The worker writes those MTP cache entries (the entry of position ``t`` goes
to the slot of ``t`` on the target's block table, so its latent and indexer caches mirror the
target's), and for requests that decode next it proposes ``num_drafts`` tokens by chaining: the
last entry's logits give draft 1; draft ``j + 1`` comes from one more MTP step at the next position
with draft ``j`` as its token and the previous MTP output ``o`` as its hidden state.

Rollback needs no work here: entries written for drafts (chained positions) are stale as soon as
the target rejects them, and the next batch starts at the first unaccepted position and overwrites
them before any query can read them (every query only reads positions at or before its own).
"""

from __future__ import annotations

import itertools
import logging
import os

import torch

from shardserve.workers.device import resolve_device, resolve_dtype
from shardserve.workers.forward_context import AttentionMetadata, forward_context
from shardserve.workers.messages import DraftBatch, DraftProposal, DraftResult
from shardserve.workers.model_runner import RequestState, allocate_caches, apply_request_diffs
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.models.mtp import build_mtp_model
from shardserve.workers.sampler import draft_sample
from shardserve.workers.step_inputs import DeviceStager, HostBatch, device_batch
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


class DraftWorker(ReloadableRank):
    """Owns the MTP module and its caches; proposes draft tokens (recovery and weight-reload
    calls come from :class:`ReloadableRank`).

    Args:
        num_threads: torch intra-op threads (the CPUs reserved for the draft).
    """

    def __init__(self, num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(max(1, num_threads))
        self.model, self.hf_config = None, None
        self.weight_record = None
        self.requests: dict[str, RequestState] = {}
        self.block_size = 0
        self.num_blocks = 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.generator = torch.Generator()
        self.stager = DeviceStager(self.device)

    @on_torch_thread
    def load(self, files: ModelFiles, hf_config, block_size: int, num_blocks: int,
             dtype: str = "auto", seed: int = 0, device: str = "auto") -> dict:
        """Load the MTP weights on ``device`` (resolved as a shard worker's, ``workers/device.py``)
        and allocate ``num_blocks`` cache blocks there (the target's count: the caches share its
        block ids).

        Returns:
            ``{"weight_bytes", "cache_bytes", "pid", "fingerprint", "shapes"}`` (see
            :class:`workers.weight_reload.WeightRecord`).

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
        self.block_size, self.num_blocks = block_size, num_blocks
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        cache_bytes = allocate_caches(self.model.attention_layers(), num_blocks, block_size, self.device)
        logger.info("draft (MTP): weights %.1f MiB, caches %.1f MiB in %d blocks", weight_bytes / 2**20,
                    cache_bytes / 2**20, num_blocks)
        return {"weight_bytes": weight_bytes, "cache_bytes": cache_bytes, "pid": os.getpid(),
                "fingerprint": self.weight_record.fingerprint(), "shapes": dict(self.weight_record.shapes)}

    def _apply(self, batch: DraftBatch) -> None:
        apply_request_diffs(self.requests, batch.finished_req_ids, batch.new_requests, batch.scheduled)

    def _forward(self, req_ids: list[str], start_pos: list[int], num_tokens: list[int], input_ids: list[int],
                 prev_hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward over packed entries; returns the block outputs ``o [T, hidden]``."""
        ids, meta = draft_inputs(start_pos, num_tokens, input_ids, [self.requests[r].block_ids for r in req_ids],
                                 self.block_size, self.stager)
        with forward_context(meta):
            return self.model(ids, meta.positions, prev_hidden)

    def _draft(self, req_ids: list[str], output_indices: list[int], out: torch.Tensor,
               drafts: dict[str, tuple[list, list]]) -> list[int]:
        """Sample one draft per row of ``out [N, hidden]``; appends ``(token, q)`` to ``drafts[req]``."""
        options = [self.requests[r].sampling for r in req_ids]
        tokens, probs = draft_sample(self.model.compute_logits(out), options, output_indices, self.generator)
        for req_id, token, q in zip(req_ids, tokens, probs):
            drafts[req_id][0].append(token)
            drafts[req_id][1].append(q)
        return tokens

    @on_torch_thread        # outside: inference mode is per thread, so it must be entered on the torch thread
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftResult:
        """Write the batch's MTP cache entries and propose drafts (see the module docstring).

        Returns:
            one :class:`DraftProposal` per request with ``num_drafts > 0``, in batch order.
        """
        self._apply(batch)
        scheduled = batch.scheduled
        if not scheduled:
            return DraftResult()
        lengths = [len(s.token_ids) for s in scheduled]
        assert batch.hidden_states.shape[0] == sum(lengths), \
            f"{batch.hidden_states.shape[0]} hidden rows for {sum(lengths)} entries"
        hidden = batch.hidden_states.to(self.device, self.dtype)     # the target's h_t, sent as float32
        out = self._forward([s.req_id for s in scheduled], [s.start_pos for s in scheduled], lengths,
                            [t for s in scheduled for t in s.token_ids], hidden)
        drafting = [i for i, s in enumerate(scheduled) if s.num_drafts > 0]
        drafts: dict[str, tuple[list, list]] = {scheduled[i].req_id: ([], []) for i in drafting}
        if drafting:
            ends = list(itertools.accumulate(lengths))
            last_rows = torch.tensor([ends[i] - 1 for i in drafting], device=self.device)
            chain = out[last_rows]                                         # [N, hidden] o of the last entry
            active = drafting
            tokens = self._draft([scheduled[i].req_id for i in active], [scheduled[i].output_index for i in active],
                                 chain, drafts)
            for step in range(1, max(scheduled[i].num_drafts for i in drafting)):
                keep = [row for row, i in enumerate(active) if scheduled[i].num_drafts > step]
                active, chain = [active[row] for row in keep], chain[torch.tensor(keep, device=self.device)]
                tokens = [tokens[row] for row in keep]
                req_ids = [scheduled[i].req_id for i in active]
                # Chained step: position of the last entry + step, token = previous draft, h = previous o.
                chain = self._forward(req_ids, [scheduled[i].start_pos + lengths[i] + step - 1 for i in active],
                                      [1] * len(active), tokens, chain)
                tokens = self._draft(req_ids, [scheduled[i].output_index + step for i in active], chain, drafts)
        proposals = []
        for req_id, (tokens, probs) in drafts.items():
            proposals.append(DraftProposal(req_id, tokens, None if probs[0] is None else torch.stack(probs).cpu()))
        return DraftResult(proposals)

    def _weights(self) -> DraftWorker:
        return self

    def shutdown(self) -> None:
        """Nothing to release (kept for symmetry with ShardWorker)."""
