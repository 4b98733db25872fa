"""Continuous-batching scheduler: one rule, computed tokens chase the target (vLLM v1).

Each step fills a token budget: running requests first (a decode costs one token, an unfinished
prefill continues as a chunk), then waiting requests in arrival order (a prefix-cache hit counts
as already computed). Prompt tokens may have a smaller budget of their own
(``max_prefill_tokens``): a burst of new requests then starts over several short steps. When the
pool runs out of blocks the newest running request is preempted (its blocks freed, recomputed
later). The output is a :class:`workers.messages.StepPlan`: new requests in full once, then
per-step diffs (tokens to compute, blocks added).

Hybrid recurrent models (Qwen3-Next) also need a state slot per running request
(:class:`cluster.engine.state_slots.StateSlots`): taken on admission together with the blocks, given back
wherever the blocks are (finish, abort, preemption; a preempted request is recomputed from
position 0 on a fresh, zeroed slot).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from shardserve.cluster.engine.block_manager import BlockManager
from shardserve.cluster.engine.request import Request, RequestStatus
from shardserve.cluster.engine.state_slots import StateSlots
from shardserve.workers.messages import PLACEHOLDER_TOKEN, NewRequestData, ScheduledRequest, StepPlan


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64                 # sequences in one step at most
    max_num_batched_tokens: int = 2048     # token budget of one step (prefill chunks included)
    max_model_len: int = 8192              # context length at most (prompt + output)
    # Prompt tokens (prefills and prefill chunks, not decodes) one step computes at most; None: only
    # the step budget. A burst of prompts is then admitted over several steps, so the first ones
    # stream while the rest prefill, instead of all waiting for one long step (issue 30).
    max_prefill_tokens: int | None = None


@dataclass(slots=True)
class ScheduledBatch:
    """One step's plan plus the coordinator-side view of it."""

    plan: StepPlan
    requests: list[Request] = field(default_factory=list)   # same order as plan.scheduled
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue and the running list; allocates blocks through the block manager
    (and recurrent-state slots through ``state_slots`` for hybrid models)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 state_slots: StateSlots | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.num_preemptions = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []   # to tell the workers in the next plan
        # False while a weight reload drains: only requests that already produced output (preempted
        # ones, queued at the front) are admitted; fresh ones wait and run on the new weights.
        self.admit_new = True
        # Set per step by the engine while the MTP draft model caches new prompts: a prefix-cache hit
        # then gives back its last block, so the draft cache entry of the last hit position (which
        # depends on the token after it) is recomputed by this request. Off, a hit costs nothing more
        # than without speculation (a cold adaptive policy: the prompts skip the draft model anyway).
        self.recompute_last_hit = False

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` (stop, length, abort or error) and free its blocks. Idempotent."""
        assert status.finished, status
        if request.status.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._free(request)
        request.grammar = None   # its matcher goes with it (kept through preemption, not past the end)
        if request.sent_to_workers:
            self._finished_ids.append(request.request_id)

    def forget_on_workers(self, request_id: str) -> None:
        """Have the next plan tell the workers to drop ``request_id``'s state."""
        self._finished_ids.append(request_id)

    def requeue(self, request: Request) -> None:
        """Send a running request back to the front of the waiting queue; its blocks (and state slot)
        are freed and it is recomputed from its first token when admitted again. Not a preemption."""
        self.running.remove(request)
        self._send_back(request)

    def forget_workers_state(self) -> None:
        """The workers lost every request's state (a rank was replaced): nothing left to tell them."""
        self._finished_ids = []

    def _free(self, request: Request) -> None:
        self.block_manager.free(request)
        if self.state_slots is not None:
            self.state_slots.free(request)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self._send_back(request)

    def _send_back(self, request: Request) -> None:
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs_row = [], -1
        if request.sent_to_workers:
            self._finished_ids.append(request.request_id)
        request.sent_to_workers, request.num_sent_blocks = False, 0
        self.waiting.appendleft(request)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and build its plan; advances ``num_computed_tokens``."""
        budget = self.config.max_num_batched_tokens
        prefill_budget = self.config.max_prefill_tokens or budget
        chosen: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not request.may_sample_more(self.config.max_model_len):   # its last token is in flight
                i += 1
                continue
            # Draft tokens are computed like any other (verified in the same forward); so is a token
            # still being sampled by the step in flight (a placeholder).
            num_new = min(request.num_known_tokens + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            prefilling = not request.spec_token_ids and num_new > 1   # a prefill chunk, not a decode
            if prefilling:
                if prefill_budget <= 0:
                    i += 1
                    continue
                num_new = min(num_new, prefill_budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chosen.append((request, num_new))
                budget -= num_new
                prefill_budget -= num_new if prefilling else 0
                i += 1
                continue
            break
        while (not preempted and self.waiting and min(budget, prefill_budget) > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if not self.admit_new and not request.num_output_tokens:
                break
            if request.num_placeholders:   # preempted while a step sampled for it: wait for that token
                break
            hits, num_hit_tokens = self.block_manager.get_computed_blocks(request)
            if self.recompute_last_hit and hits:
                hits, num_hit_tokens = hits[:-1], num_hit_tokens - self.block_manager.block_size
            num_new = min(request.num_tokens - num_hit_tokens, budget, prefill_budget)
            if self.state_slots is not None and not self.state_slots.num_free:
                break
            if not self.block_manager.allocate_slots(request, num_new, hits):
                break
            if self.state_slots is not None:
                self.state_slots.allocate(request)
            request.num_computed_tokens = num_hit_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
            prefill_budget -= num_new
        return self._build_plan(chosen, preempted)

    def _build_plan(self, chosen: list[tuple[Request, int]], preempted: list[Request]) -> ScheduledBatch:
        plan = StepPlan()
        if chosen:   # an empty plan is not executed: keep the notices for the next one
            plan.finished_req_ids, self._finished_ids = self._finished_ids, []
        batch = ScheduledBatch(plan, preempted=preempted)
        for request, num_new in chosen:
            if not request.sent_to_workers:
                options = request.sampling_options()
                history = request.all_token_ids if options.has_controls else None   # complete: no placeholders
                plan.new_requests.append(NewRequestData(request.request_id, options, request.state_slot, history,
                                                        request.num_prompt_tokens))
                request.sent_to_workers = True
            start = request.num_computed_tokens
            known = request.num_known_tokens
            # Drafts that did not fit the budget are dropped; the rest are verified and consumed.
            num_spec = max(0, start + num_new - known) if request.spec_token_ids else 0
            token_ids = request.all_token_ids[start:start + num_new - num_spec]
            token_ids += [PLACEHOLDER_TOKEN] * (num_new - num_spec - len(token_ids))
            sample = start + num_new - num_spec == known
            plan.scheduled.append(ScheduledRequest(
                req_id=request.request_id,
                token_ids=token_ids + request.spec_token_ids[:num_spec],
                start_pos=start,
                new_block_ids=request.block_ids[request.num_sent_blocks:],
                sample=sample,
                output_index=request.num_output_tokens + request.num_placeholders,
                num_spec_tokens=num_spec,
                draft_probs_row=request.spec_probs_row if num_spec else -1,
            ))
            request.spec_token_ids, request.spec_probs_row = [], -1
            request.num_sent_blocks = len(request.block_ids)
            request.num_computed_tokens += num_new
            request.num_placeholders += sample   # given back by EngineCore.update when the result is in
            batch.requests.append(request)
        return batch

