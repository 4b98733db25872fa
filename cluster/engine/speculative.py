"""MTP speculative decoding: draft k tokens per decoding sequence, verify them in one target step.

The engine keeps its one scheduling rule (vLLM v1): a request's draft tokens
(``Request.spec_token_ids``) are extra tokens to compute, so ``num_computed_tokens`` chases
``num_tokens + len(spec_token_ids)`` and the target scores the last real token and every draft in
one forward (``k + 1`` query rows; DSA top-k is causal per query row). Rank 0 accepts a prefix
of the drafts (``workers/sampler.py``: greedy prefix match, or rejection sampling) and returns
it plus one more token; the engine appends them through the ordinary stop checks and rolls
``num_computed_tokens`` back to ``num_tokens - 1``. With position-addressed paged caches that *is*
the rollback, for every cache (target latent + indexer keys, draft latent + indexer keys): slots
past it are stale and are overwritten before anything reads them. Blocks allocated for rejected
positions stay with the request (it grows into them) and are freed with it; only blocks full of
accepted tokens are ever hashed into the prefix cache.

After each step, :class:`Speculator` sends the draft worker the positions the target just computed
and accepted (token ``x_{t+1}`` and hidden ``h_t`` of each; prefill chunks included, so the MTP
cache covers the whole context) and gets back ``k`` new drafts for each request that decodes next.
Per request, ``k`` shrinks so that neither ``max_tokens`` nor the context length can be passed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from shardserve.cluster.engine.request import RequestStatus
from shardserve.workers.messages import DraftBatch, DraftRequest, DraftResult, NewRequestData, StepResult

if TYPE_CHECKING:
    from shardserve.cluster.engine.engine import EngineCore
    from shardserve.cluster.engine.scheduler import ScheduledBatch

MAX_SPECULATIVE_TOKENS = 4


class Drafter(Protocol):
    """A draft model: :class:`workers.draft_worker.DraftWorker` in process, or its Ray actor."""

    def propose(self, batch: DraftBatch) -> DraftResult: ...


@dataclass(slots=True)
class SpecStats:
    """Acceptance counters (vLLM's ``spec_decode`` metrics). One *draft* = one sequence verifying
    its draft tokens in one target forward."""

    num_speculative_tokens: int
    num_drafts: int = 0                  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0            # draft tokens verified by the target
    num_accepted_tokens: int = 0         # of those, accepted
    drafted_per_position: list[int] = field(default_factory=list)    # [k] verified at position i + 1
    accepted_per_position: list[int] = field(default_factory=list)   # [k] accepted at position i + 1

    def __post_init__(self) -> None:
        self.drafted_per_position = [0] * self.num_speculative_tokens
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one sequence-step that verified ``num_draft_tokens`` and accepted ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_draft_tokens):
            self.drafted_per_position[pos] += 1
            self.accepted_per_position[pos] += pos < num_accepted

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Fraction of draft tokens accepted at each draft position (1..k)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying sequence-step: accepted drafts + the bonus/corrected token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"speculative_tokens": self.num_speculative_tokens, "spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens, "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.acceptance_rate_per_position,
                "spec_mean_acceptance_length": self.mean_acceptance_length}

    def collector(self, prefix: str = "shardserve"):
        """A ``prometheus_client`` collector exposing these counters (register it in any registry)."""
        return _SpecCollector(self, prefix)

    def prometheus_text(self, prefix: str = "shardserve") -> str:
        """The counters in Prometheus text exposition format."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(self.collector(prefix))
        return generate_latest(registry).decode()


class _SpecCollector:
    def __init__(self, stats: SpecStats, prefix: str) -> None:
        self.stats, self.prefix = stats, prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats, p = self.stats, self.prefix
        yield CounterMetricFamily(f"{p}_spec_drafts", "Sequence-steps that verified draft tokens", stats.num_drafts)
        yield CounterMetricFamily(f"{p}_spec_draft_tokens", "Draft tokens verified by the target",
                                  stats.num_draft_tokens)
        yield CounterMetricFamily(f"{p}_spec_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens)
        per_pos = CounterMetricFamily(f"{p}_spec_accepted_tokens_per_position", "Draft tokens accepted, by position",
                                      labels=["position"])
        for pos, count in enumerate(stats.accepted_per_position):
            per_pos.add_metric([str(pos + 1)], count)
        yield per_pos
        rate = GaugeMetricFamily(f"{p}_spec_acceptance_rate", "Acceptance rate by draft position",
                                 labels=["position"])
        for pos, value in enumerate(stats.acceptance_rate_per_position):
            rate.add_metric([str(pos + 1)], value)
        yield rate
        yield GaugeMetricFamily(f"{p}_spec_mean_acceptance_length",
                                "Tokens emitted per verifying sequence-step (accepted + 1)",
                                stats.mean_acceptance_length)


def _token_slice(request, start: int, stop: int) -> list[int]:
    """``request.all_token_ids[start:stop]`` without copying the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt):stop - len(prompt)]
    return prompt[start:stop] + output[:max(0, stop - len(prompt))]


class Speculator:
    """Drives a draft model around the engine's steps.

    Args:
        drafter: the draft model (its caches use the engine's block ids).
        num_speculative_tokens: ``k``, draft tokens per decoding sequence per step (1..4).
    """

    def __init__(self, drafter: Drafter, num_speculative_tokens: int) -> None:
        if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens}")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.stats = SpecStats(num_speculative_tokens)
        self._num_sent_blocks: dict[str, int] = {}   # requests the draft worker knows: blocks it has
        self._pending_finished: list[str] = []

    def reset(self) -> None:
        """Forget what the draft worker knows (it was replaced or reset; no request is left)."""
        self._num_sent_blocks.clear()
        self._pending_finished = []

    def record(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Count accepted drafts (before any stop truncates the run)."""
        emitted = Counter(s.req_id for s in result.sampled)
        for sched in batch.plan.scheduled:
            if sched.num_spec_tokens:
                self.stats.add(sched.num_spec_tokens, emitted[sched.req_id] - 1)

    def _num_drafts(self, core: EngineCore, request) -> int:
        """``k``, cut so that no draft can land past ``max_tokens`` or the context length."""
        k = min(self.num_speculative_tokens, core.max_model_len - request.num_tokens)
        if request.params.max_tokens is not None:
            k = min(k, request.params.max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def build(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> DraftBatch | None:
        """The draft worker's work after ``core.update(batch, result)``; allocates the blocks the
        drafts will occupy. None when there is nothing to send."""
        assert result.hidden_states is not None or not batch.plan.scheduled, \
            "speculation needs the target's hidden states (plan.return_hidden)"
        self._pending_finished += batch.plan.finished_req_ids
        for req_id in batch.plan.finished_req_ids:
            self._num_sent_blocks.pop(req_id, None)
        out = DraftBatch()
        rows, offset = [], 0
        for request, sched in zip(batch.requests, batch.plan.scheduled):
            start, count = sched.start_pos, len(sched.token_ids)
            offset += count
            if request.status != RequestStatus.RUNNING:   # finished (or aborted) in this step
                continue
            valid = min(count, request.num_computed_tokens - start)   # positions whose tokens were accepted
            num_drafts = 0
            if request.num_computed_tokens == request.num_tokens - 1:   # decodes next
                num_drafts = self._num_drafts(core, request)
                # blocks for the drafts' positions (the next verify needs them anyway)
                new_slots = request.num_tokens + num_drafts - request.num_computed_tokens
                if num_drafts and not core.block_manager.allocate_slots(request, new_slots):
                    num_drafts = 0
            req_id = request.request_id
            if req_id not in self._num_sent_blocks:
                out.new_requests.append(NewRequestData(req_id, request.params.sampling_options()))
                self._num_sent_blocks[req_id] = 0
            new_blocks = request.block_ids[self._num_sent_blocks[req_id]:]
            self._num_sent_blocks[req_id] = len(request.block_ids)
            out.scheduled.append(DraftRequest(req_id, _token_slice(request, start + 1, start + 1 + valid), start,
                                              new_blocks, num_drafts, request.num_output_tokens))
            rows.append(result.hidden_states[offset - count:offset - count + valid])
        if not out.scheduled:
            return None
        out.finished_req_ids, self._pending_finished = self._pending_finished, []
        out.hidden_states = torch.cat(rows)
        return out

    def apply(self, core: EngineCore, result: DraftResult) -> None:
        """Store the proposals on their requests (skipping any finished meanwhile)."""
        for proposal in result.proposals:
            tracked = core.requests.get(proposal.req_id)
            if tracked is not None and tracked.request.status == RequestStatus.RUNNING:
                tracked.request.spec_token_ids = list(proposal.token_ids)
                tracked.request.spec_probs = proposal.probs

    def propose(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> None:
        """Build, run (blocking) and apply one drafting pass."""
        draft_batch = self.build(core, batch, result)
        if draft_batch is not None:
            self.apply(core, self.drafter.propose(draft_batch))

    async def propose_async(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> None:
        """:meth:`propose` with the draft model running in a thread (the coordinator's event loop)."""
        draft_batch = self.build(core, batch, result)
        if draft_batch is not None:
            self.apply(core, await asyncio.to_thread(self.drafter.propose, draft_batch))
