"""MTP speculative decoding: draft tokens per decoding sequence, verify them in one target step.

The engine keeps its one scheduling rule (vLLM v1): a request's draft tokens
(``Request.spec_token_ids``) are extra tokens to compute, so ``num_computed_tokens`` chases
``num_tokens + len(spec_token_ids)`` and the target scores the last real token and every draft in
one forward (``k + 1`` query rows; DSA top-k is causal per query row). Rank 0 accepts a prefix
of the drafts (``workers/rejection_sampler.py``: greedy prefix match, or rejection sampling) and
returns it plus one more token; the engine appends them through the ordinary stop checks and rolls
``num_computed_tokens`` back to ``num_tokens - 1``. With position-addressed paged caches that *is*
the rollback, for every cache (target latent + indexer keys, draft latent + indexer keys): slots
past it are stale and are overwritten before anything reads them. Blocks allocated for rejected
positions stay with the request (it grows into them) and are freed with it; only blocks full of
accepted tokens are ever hashed into the prefix cache.

After each step, :class:`Speculator` asks its policy (``cluster/engine/spec_policy.py``) how deep
each request that decodes next should draft, and sends the draft worker the positions the target
just computed and accepted (token ``x_{t+1}`` of each and the row of its hidden state ``h_t`` in the
buffer rank 0 shares with the draft worker; prefill chunks included, so the MTP cache covers the
whole context) and gets back the drafts. A step whose hidden states the policy does not want (it
drafts nothing and keeps the draft model cold) skips the draft worker. Per request the depth is cut
so that neither ``max_tokens`` nor the context length can be passed. Drafts live one step: those of
a request the next step does not verify are dropped (their ``q`` rows are rewritten by the next pass).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shardserve.cluster.engine.request import RequestStatus
from shardserve.cluster.engine.spec_policy import Candidate, make_policy
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
    """Acceptance counters (vLLM's ``spec_decode`` metrics) and the depths the policy chose. One
    *draft* = one sequence verifying its draft tokens in one target forward."""

    num_speculative_tokens: int
    policy: str = "fixed"
    num_drafts: int = 0                  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0            # draft tokens verified by the target
    num_accepted_tokens: int = 0         # of those, accepted
    drafted_per_position: list[int] = field(default_factory=list)    # [k] verified at position i + 1
    accepted_per_position: list[int] = field(default_factory=list)   # [k] accepted at position i + 1
    depth_steps: list[int] = field(default_factory=list)             # [k + 1] decoding sequence-steps per depth

    def __post_init__(self) -> None:
        self.drafted_per_position = [0] * self.num_speculative_tokens
        self.accepted_per_position = [0] * self.num_speculative_tokens
        self.depth_steps = [0] * (self.num_speculative_tokens + 1)

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
        """The ModelInfo fields (``proto/inference.proto``)."""
        return {"speculative_tokens": self.num_speculative_tokens, "spec_policy": self.policy,
                "spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.acceptance_rate_per_position,
                "spec_mean_acceptance_length": self.mean_acceptance_length,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_depth_steps": list(self.depth_steps)}

    def prometheus_text(self, model_name: str = "") -> str:
        """The counters in Prometheus text exposition format (:func:`spec_metric_families`)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(SpecCollector(lambda: [(model_name, None, self.as_dict())]))
        return generate_latest(registry).decode()


class SpecCollector:
    """A ``prometheus_client`` collector of :func:`spec_metric_families` over ``rows()``."""

    def __init__(self, rows) -> None:
        self.rows = rows

    def collect(self):
        return spec_metric_families(self.rows())


def spec_metric_families(rows: list[tuple[str, str | None, dict]]):
    """Prometheus families of speculative-decoding counters.

    vLLM's (labels ``model_name`` and ``engine``, the replica; ``position`` 0-based):
    ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``,
    ``_num_accepted_tokens_per_pos{position}`` (counters, exposed with ``_total``). shardserve's
    (label ``replica`` when given): ``shardserve_spec_drafts``, ``_draft_tokens``,
    ``_accepted_tokens`` (counters), ``shardserve_spec_acceptance_rate{position}`` (1-based),
    ``_mean_acceptance_length`` (gauges), ``shardserve_spec_depth_steps{depth}`` (counter: decoding
    sequence-steps the policy drafted ``depth`` tokens for; 0 = none).

    Args:
        rows: ``(model name, replica label or None, fields)`` per replica; ``fields`` are
            :meth:`SpecStats.as_dict`'s (the ModelInfo fields).
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    ours_labels = ["replica"] if rows and rows[0][1] is not None else []

    def ours(replica: str | None, *extra: str) -> list[str]:
        return ([replica] if ours_labels else []) + list(extra)

    counters = [("spec_decode_num_drafts", "spec_drafts", "Sequence-steps that verified draft tokens", "spec_num_drafts"),
                ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Draft tokens verified by the target",
                 "spec_num_draft_tokens"),
                ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted",
                 "spec_num_accepted_tokens")]
    for vllm_name, our_name, doc, key in counters:
        theirs = CounterMetricFamily(f"vllm:{vllm_name}", doc, labels=["model_name", "engine"])
        mine = CounterMetricFamily(f"shardserve_{our_name}", doc, labels=ours_labels)
        for model, replica, fields in rows:
            theirs.add_metric([model, replica or "0"], fields[key])
            mine.add_metric(ours(replica), fields[key])
        yield theirs
        yield mine
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position (0-based)",
                                  labels=["model_name", "engine", "position"])
    rate = GaugeMetricFamily("shardserve_spec_acceptance_rate", "Acceptance rate by draft position",
                             labels=ours_labels + ["position"])
    length = GaugeMetricFamily("shardserve_spec_mean_acceptance_length",
                               "Tokens emitted per verifying sequence-step (accepted + 1)", labels=ours_labels)
    depths = CounterMetricFamily("shardserve_spec_depth_steps", "Decoding sequence-steps by the number of draft "
                                 "tokens the speculation policy chose (0 = none)", labels=ours_labels + ["depth"])
    for model, replica, fields in rows:
        for pos, count in enumerate(fields["spec_accepted_per_position"]):
            per_pos.add_metric([model, replica or "0", str(pos)], count)
        for pos, value in enumerate(fields["spec_acceptance_rate"]):
            rate.add_metric(ours(replica, str(pos + 1)), value)
        length.add_metric(ours(replica), fields["spec_mean_acceptance_length"])
        for depth, count in enumerate(fields["spec_depth_steps"]):
            depths.add_metric(ours(replica, str(depth)), count)
    yield from (per_pos, rate, length, depths)


def _token_slice(request, start: int, stop: int) -> list[int]:
    """``request.all_token_ids[start:stop]`` without copying the whole sequence."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt):stop - len(prompt)]
    return prompt[start:stop] + output[:max(0, stop - len(prompt))]


def _step_shape(plan) -> tuple[int, int]:
    """``(decoding requests, prefill tokens)`` of a step's plan: a request decodes when its row
    count is one plus its drafts; every row of any other request is a prompt token."""
    decoding = [s.sample and len(s.token_ids) == 1 + s.num_spec_tokens for s in plan.scheduled]
    return sum(decoding), sum(len(s.token_ids) for s, d in zip(plan.scheduled, decoding) if not d)


class Speculator:
    """Drives a draft model around the engine's steps.

    Args:
        drafter: the draft model (its caches use the engine's block ids).
        num_speculative_tokens: ``K``, the most draft tokens per decoding sequence per step (1..4).
        policy: ``"adaptive"`` (draft only where it pays) or ``"fixed"`` (always ``K``).

    Raises:
        ValueError: ``K`` out of range or an unknown policy.
    """

    def __init__(self, drafter: Drafter, num_speculative_tokens: int, policy: str = "adaptive") -> None:
        if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens}")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.policy = make_policy(policy, num_speculative_tokens)
        self.stats = SpecStats(num_speculative_tokens, self.policy.name)
        self._num_sent_blocks: dict[str, int] = {}   # requests the draft worker knows: blocks it has
        self._pending_finished: list[str] = []

    def reset(self) -> None:
        """Forget what the draft worker knows (it was replaced or reset; no request is left)."""
        self._num_sent_blocks.clear()
        self._pending_finished = []

    def wants_hidden(self, batch: ScheduledBatch, batch_after: int) -> bool:
        """Whether this step's hidden states will feed a draft pass (``plan.return_hidden``);
        ``batch_after``: the decoding batch this step's new requests join (requests held, capped)."""
        return self.policy.wants_hidden(*_step_shape(batch.plan), batch_after)

    def caches_prompts(self, batch_after: int) -> bool:
        """Whether prompts admitted now will likely go through the draft model (their prefix-cache
        hits then recompute the last hit block, see ``Scheduler.recompute_last_hit``)."""
        return self.policy.caches_prompts(batch_after)

    def record(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Count accepted drafts (before any stop truncates the run), per request and in total
        (``request.spec`` is set when the engine admits a request); a step that verified no draft
        has nothing to count."""
        if not any(sched.num_spec_tokens for sched in batch.plan.scheduled):
            return
        emitted = Counter(s.req_id for s in result.sampled)
        for request, sched in zip(batch.requests, batch.plan.scheduled):
            if sched.num_spec_tokens:
                accepted = emitted[sched.req_id] - 1
                self.stats.add(sched.num_spec_tokens, accepted)
                self.policy.observe_acceptance(sched.req_id, sched.num_spec_tokens, accepted)
                request.spec.num_drafts += 1
                request.spec.num_draft_tokens += sched.num_spec_tokens
                request.spec.num_accepted_tokens += accepted

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A finished target step (``seconds``: schedule to update, engine overhead included)."""
        num_seqs, prompt_tokens = _step_shape(batch.plan)
        self.policy.observe_step(num_seqs, prompt_tokens, sum(s.num_spec_tokens for s in batch.plan.scheduled), seconds)

    def _num_drafts(self, core: EngineCore, request) -> int:
        """``K``, cut so that no draft can land past ``max_tokens`` or the context length."""
        k = min(self.num_speculative_tokens, core.max_model_len - request.num_tokens)
        if request.params.max_tokens is not None:
            k = min(k, request.params.max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def _depths(self, core: EngineCore, batch: ScheduledBatch) -> dict[str, int]:
        """The policy's drafts per request that decodes next step."""
        decoding = [r for r in batch.requests
                    if r.status == RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1]
        if self.policy.stays_cold(len(decoding)):
            return dict.fromkeys((r.request_id for r in decoding), 0)
        candidates = [Candidate(r.request_id, self._num_drafts(core, r)) for r in decoding]
        in_flight = 0 if decoding else _step_shape(batch.plan)[0]   # all in the step sent ahead
        batch_after = min(core.scheduler.num_unfinished, core.scheduler.config.max_num_seqs)
        return {c.req_id: depth for c, depth in zip(candidates, self.policy.depths(candidates, in_flight, batch_after))}

    def build(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> DraftBatch | None:
        """The draft worker's work after ``core.update(batch, result)``; allocates the blocks the
        drafts will occupy. None when there is nothing to send (or the step kept no hidden states)."""
        self._pending_finished += batch.plan.finished_req_ids
        for req_id in batch.plan.finished_req_ids:
            self._num_sent_blocks.pop(req_id, None)
            self.policy.forget(req_id)
        depths = self._depths(core, batch)
        if not batch.plan.return_hidden:   # cold: the draft model skips this step, nothing is drafted
            self.stats.depth_steps[0] += len(depths)
            return None
        for depth in depths.values():
            self.stats.depth_steps[depth] += 1
        out = DraftBatch(hidden_states=result.hidden_states)
        offset = 0
        for request, sched in zip(batch.requests, batch.plan.scheduled):
            start, count = sched.start_pos, len(sched.token_ids)
            offset += count
            if request.status != RequestStatus.RUNNING:   # finished (or aborted) in this step
                continue
            valid = min(count, request.num_computed_tokens - start)   # positions whose tokens were accepted
            num_drafts = depths.get(request.request_id, 0)
            if num_drafts:   # blocks for the drafts' positions (the next verify needs them anyway)
                new_slots = request.num_tokens + num_drafts - request.num_computed_tokens
                if not core.block_manager.allocate_slots(request, new_slots):
                    num_drafts = 0
            req_id = request.request_id
            if req_id not in self._num_sent_blocks:
                out.new_requests.append(NewRequestData(req_id, request.params.sampling_options()))
                self._num_sent_blocks[req_id] = 0
            new_blocks = request.block_ids[self._num_sent_blocks[req_id]:]
            self._num_sent_blocks[req_id] = len(request.block_ids)
            out.scheduled.append(DraftRequest(req_id, _token_slice(request, start + 1, start + 1 + valid), start,
                                              new_blocks, num_drafts, request.num_output_tokens))
            out.hidden_rows.extend(range(offset - count, offset - count + valid))
        if not out.scheduled:
            return None
        out.finished_req_ids, self._pending_finished = self._pending_finished, []
        return out

    def apply(self, core: EngineCore, result: DraftResult) -> None:
        """Store the proposals on their requests (skipping any finished meanwhile); every other
        running request's drafts are dropped (their ``q`` rows were rewritten)."""
        proposals = {p.req_id: p for p in result.proposals}
        for request in core.scheduler.running:
            proposal = proposals.get(request.request_id)
            if proposal is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids, request.spec_probs_row = list(proposal.token_ids), proposal.probs_row
            else:
                request.spec_token_ids, request.spec_probs_row = [], -1

    def _observe_draft(self, batch: DraftBatch, seconds: float) -> None:
        depths = [s.num_drafts for s in batch.scheduled]
        depth = max(depths)
        chain_rows = sum(sum(1 for d in depths if d > step) for step in range(1, depth))
        self.policy.observe_draft(depth, chain_rows, sum(len(s.token_ids) for s in batch.scheduled), seconds)

    def propose(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> None:
        """Build, run (blocking) and apply one drafting pass; its time (bookkeeping included)
        feeds the policy."""
        started = time.perf_counter()
        draft_batch = self.build(core, batch, result)
        if draft_batch is not None:
            self.apply(core, self.drafter.propose(draft_batch))
            self._observe_draft(draft_batch, time.perf_counter() - started)

    async def propose_async(self, core: EngineCore, batch: ScheduledBatch, result: StepResult) -> None:
        """:meth:`propose` with the draft model running in a thread (the coordinator's event loop)."""
        started = time.perf_counter()
        draft_batch = self.build(core, batch, result)
        if draft_batch is not None:
            self.apply(core, await asyncio.to_thread(self.drafter.propose, draft_batch))
            self._observe_draft(draft_batch, time.perf_counter() - started)
