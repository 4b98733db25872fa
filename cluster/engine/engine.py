"""Engine core: ``step = schedule -> execute -> update`` over any executor.

The executor runs a :class:`workers.messages.StepPlan` and returns rank 0's
:class:`workers.messages.StepResult`: a local :class:`workers.model_runner.ModelRunner` in one
process, or the Ray worker group in the cluster. Everything here is CPU-only bookkeeping:
validation, scheduling, stop conditions, detokenization, finish reasons, usage.

With a speculator (``cluster/engine/speculative.py``) a step may return several tokens per request (the
accepted drafts plus one); they are appended one by one through the same stop checks, the output
ends at the first stop, and the request's computed tokens roll back to what the caches hold.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from shardserve.cluster.engine.block_manager import BlockManager
from shardserve.cluster.engine.detokenizer import IncrementalDetokenizer
from shardserve.cluster.engine.grammar import GrammarState
from shardserve.cluster.engine.request import (Logprob, Request, RequestStatus, RequestTimes, SamplingParams,
                                                SpecUsage, tokenize_bad_words)
from shardserve.cluster.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from shardserve.cluster.engine.state_slots import StateSlots
from shardserve.workers.messages import NewRequestData, SampledToken, ScheduledRequest, StepPlan, StepResult

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a streaming delta)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob]
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    num_cached_tokens: int = 0       # prompt tokens taken from the prefix cache
    spec_decode: SpecUsage | None = None     # the request's speculative decoding so far (speculation on)
    times: RequestTimes | None = None        # where its time went (the final output of one that stopped)


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


class EngineCore:
    """Scheduler + block manager + detokenizers in front of an executor.

    Args:
        executor: runs step plans.
        tokenizer: transformers tokenizer (for detokenization).
        num_blocks / block_size: the KV pool (the minimum over all ranks).
        scheduler_config: budgets; ``max_model_len`` is capped to what the pool can hold.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        vocab_size: the model's vocabulary (prompt ids must be below it).
        speculator: MTP speculative decoding (``cluster.engine.speculative.Speculator``), or None.
        num_state_slots: recurrent-state slots of a hybrid model (every worker's
            ``num_state_slots``; 0: no recurrent layers). Prefix caching is turned off for such
            models: a cached prefix's KV blocks are useless without the recurrent state at its end.
        grammar_compiler: compiles structured-output constraints (``cluster.frontend.structured.
            GrammarCompiler``); None: constrained requests are refused.
    """

    def __init__(self, executor: Executor, tokenizer, num_blocks: int, block_size: int,
                 scheduler_config: SchedulerConfig, eos_token_ids: set[int], vocab_size: int,
                 enable_prefix_caching: bool = True, speculator=None, num_state_slots: int = 0,
                 grammar_compiler=None) -> None:
        self.executor = executor
        self.grammar_compiler = grammar_compiler
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        state_slots = StateSlots(num_state_slots) if num_state_slots else None
        if state_slots is not None and enable_prefix_caching:
            logger.info("prefix caching is off: this model keeps a recurrent state per sequence (gated "
                        "DeltaNet layers), which cached KV blocks cannot restore")
            enable_prefix_caching = False
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        scheduler_config.max_model_len = min(scheduler_config.max_model_len, num_blocks * block_size)
        self.scheduler = Scheduler(scheduler_config, self.block_manager, state_slots)
        self.max_model_len = scheduler_config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.speculator = speculator

    # -- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request the engine cannot serve (message says why)."""
        params.validate(self.vocab_size)
        if params.structured_outputs is not None and self.grammar_compiler is None:
            raise ValueError("structured_outputs: this engine has no grammar compiler")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; this model's context length is "
                             f"{self.max_model_len} tokens (prompt + at least one output token)")
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's context length is {self.max_model_len} tokens: the prompt has "
                f"{len(prompt_token_ids)} tokens and max_tokens asks for {params.max_tokens} more "
                f"({len(prompt_token_ids) + params.max_tokens} in all); ask for max_tokens <= "
                f"{self.max_model_len - len(prompt_token_ids)}")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    cache_seed: int = 0, compiled_grammar=None) -> str:
        """Queue a request; returns its id.

        Args:
            cache_seed: its prefix-cache chain's start (:func:`cluster.engine.block_manager.cache_seed`;
                0 = shared with every unsalted request).
            compiled_grammar: ``params.structured_outputs`` compiled (the coordinator compiles off
                its event loop first); None: compiled here, blocking.

        Raises:
            ValueError: invalid parameters or prompt (see :meth:`validate`), a constraint that does
                not compile (message starts ``structured_outputs:``), or a duplicate id.
        """
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(self.tokenizer, params.bad_words))
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                          cache_seed=cache_seed)
        if self.speculator is not None:
            request.spec = SpecUsage()
        if params.structured_outputs is not None:
            if compiled_grammar is None:
                compiled_grammar = self.grammar_compiler.compile(params.structured_outputs)
            request.grammar = GrammarState(compiled_grammar, self.vocab_size, params.structured_outputs.start_after)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                                             min_tokens=params.min_tokens)
        self.requests[request_id] = _Tracked(request, detokenizer)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its blocks (no-op for unknown or finished ids)."""
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """This step's plan (empty ``plan.scheduled`` when there is nothing to run); a constrained
        request that samples carries its token bitmask (``cluster/engine/grammar.py``)."""
        self._check_drafts()
        # the decoding batch this step's new requests join: every request held, up to max_num_seqs
        batch_after = min(self.scheduler.num_unfinished, self.scheduler.config.max_num_seqs)
        self.scheduler.recompute_last_hit = self.speculator is not None and self.speculator.caches_prompts(batch_after)
        batch = self.scheduler.schedule()
        if self.speculator is not None and batch.plan.scheduled:
            # the MTP needs h_t of every computed position, unless its policy skips the next pass
            batch.plan.return_hidden = self.speculator.wants_hidden(batch, batch_after)
        for request, sched in zip(batch.requests, batch.plan.scheduled):
            if sched.sample and request.grammar is not None:
                drafts = sched.token_ids[len(sched.token_ids) - sched.num_spec_tokens:]
                sched.token_bitmask = request.grammar.bitmask(drafts)
        return batch

    def _check_drafts(self) -> None:
        """Cut each constrained request's drafts at the first one its grammar rejects (it could
        never be accepted: its target probability is masked to zero)."""
        for request in self.scheduler.running:
            if request.grammar is not None and request.spec_token_ids:
                keep = request.grammar.valid_prefix(request.spec_token_ids)
                if keep < len(request.spec_token_ids):
                    request.spec_token_ids = request.spec_token_ids[:keep]   # q's row keeps its first rows

    def update(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Apply rank 0's samples for ``batch``: append tokens, check stops, emit deltas.
        Requests aborted while the step ran are skipped."""
        verified = set()
        for request, sched in zip(batch.requests, batch.plan.scheduled):
            request.num_placeholders -= sched.sample
            if sched.num_spec_tokens:   # verified drafts: hashed after the rollback, in _append
                verified.add(sched.req_id)
            else:
                self.block_manager.cache_full_blocks(request)
        if self.speculator is not None:
            self.speculator.record(batch, result)
        by_request: dict[str, list[SampledToken]] = {}
        for sampled in result.sampled:   # a request that verified drafts has several, in order
            by_request.setdefault(sampled.req_id, []).append(sampled)
        outputs = []
        for req_id, samples in by_request.items():
            tracked = self.requests.get(req_id)
            if tracked is not None:
                outputs.append(self._append(tracked, samples, req_id in verified))
        return outputs

    def step(self) -> list[RequestOutput]:
        """Schedule, execute (blocking), update; with a speculator, then draft the next tokens."""
        started = time.perf_counter()
        batch = self.schedule()
        if not batch.plan.scheduled:
            return []
        result = self.executor.execute(batch.plan)
        outputs = self.update(batch, result)
        if self.speculator is not None:
            self.speculator.observe_step(batch, time.perf_counter() - started)
            self.speculator.propose(self, batch, result)
        return outputs

    def _append(self, tracked: _Tracked, samples: list[SampledToken], verified: bool = False) -> RequestOutput:
        request = tracked.request
        new_ids, new_logprobs, status = [], [], None
        for sampled in samples:   # stop at the first stop: nothing after it is emitted
            request.output_token_ids.append(sampled.token_id)
            new_ids.append(sampled.token_id)
            if sampled.logprob is not None:
                new_logprobs.append(Logprob(sampled.token_id, sampled.logprob, sampled.top_logprobs or []))
            status = self._check_stop(request, tracked.detokenizer, sampled.token_id)
            if status is not None:
                break
        request.logprobs.extend(new_logprobs)
        if new_ids and request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if verified:
            # Speculative rollback: the caches hold every token but the newest one (positions of
            # rejected drafts, or of tokens cut by a stop, are stale and get overwritten later).
            # Only then are full blocks hashed, so the prefix cache sees accepted tokens only.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.block_manager.cache_full_blocks(request)
        if status is not None:
            self.scheduler.finish(request, status)
            del self.requests[request.request_id]
        return RequestOutput(
            request.request_id, new_ids, tracked.detokenizer.delta(final=status is not None),
            new_logprobs, status is not None, status.finish_reason if status else None,
            request.num_prompt_tokens, request.num_output_tokens, num_cached_tokens=request.num_cached_tokens,
            spec_decode=request.spec, times=RequestTimes.of(request, time.monotonic()) if status is not None else None)

    def _check_stop(self, request: Request, detok: IncrementalDetokenizer, token_id: int) -> RequestStatus | None:
        params = request.params
        grammar = request.grammar
        if grammar is not None:
            if not grammar.accept(token_id):   # rank 0 masks every token the grammar forbids
                logger.error("request %s: token %d breaks its grammar; ending it", request.request_id, token_id)
                return RequestStatus.FINISHED_STOPPED
            if grammar.is_terminated:   # the stop token that completes the grammar (ends even with ignore_eos)
                return RequestStatus.FINISHED_STOPPED
        is_eos = not params.ignore_eos and token_id in request.eos_token_ids
        if is_eos or token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        detok.add(token_id)
        if detok.stopped:
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def probe_plan(self, prompt_ids: list[int]) -> tuple[StepPlan, Request]:
        """A one-off plan that prefills ``prompt_ids`` on blocks borrowed from the pool and returns
        last-position logits (tests and debugging; run it between steps). Give the probe back with
        :meth:`release_probe` whether or not the plan ran.

        Raises:
            ValueError: the prompt is empty or does not fit the free blocks.
        """
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        probe = Request(f"probe-{next(self._ids)}", list(prompt_ids), SamplingParams(temperature=0))
        state_slots = self.scheduler.state_slots
        if state_slots is not None and not state_slots.num_free:
            raise ValueError("no free recurrent-state slot for a probe")
        if not self.block_manager.allocate_slots(probe, len(prompt_ids)):
            raise ValueError(f"{len(prompt_ids)} tokens do not fit the {self.block_manager.num_free_blocks} free blocks")
        if state_slots is not None:
            state_slots.allocate(probe)
        plan = StepPlan([NewRequestData(probe.request_id, probe.params.sampling_options(), probe.state_slot)],
                        [ScheduledRequest(probe.request_id, probe.prompt_token_ids, 0, list(probe.block_ids), True, 0)],
                        finished_req_ids=[], return_logits=True)
        return plan, probe

    def release_probe(self, probe: Request) -> None:
        """Free a probe's blocks (and state slot) and have the workers forget it."""
        self.block_manager.free(probe)
        if self.scheduler.state_slots is not None:
            self.scheduler.state_slots.free(probe)
        self.scheduler.forget_on_workers(probe.request_id)

    def prompt_logits(self, prompt_ids: list[int]):
        """Last-position logits of ``prompt_ids``, ``[vocab]`` float32 (blocking; see :meth:`probe_plan`)."""
        plan, probe = self.probe_plan(prompt_ids)
        try:
            return self.executor.execute(plan).logits[0]
        finally:
            self.release_probe(probe)

    # -- weight reload and recovery --------------------------------------------------------------
    def has_started(self) -> bool:
        """Whether a request is running or waits after a preemption with output already sent."""
        return bool(self.scheduler.running) or any(r.num_output_tokens for r in self.scheduler.waiting)

    def interrupt_started(self, message: str) -> list[RequestOutput]:
        """Abort every request that has produced output (``finish_reason="abort"``, ``error=message``)
        and send running ones that have not back to the waiting queue (recomputed later, unseen)."""
        outputs = []
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            if not request.num_output_tokens:
                if request.status == RequestStatus.RUNNING:
                    self.scheduler.requeue(request)
                continue
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            del self.requests[request.request_id]
            outputs.append(RequestOutput(request.request_id, [], "", [], True, "abort", request.num_prompt_tokens,
                                         request.num_output_tokens, error=message))
        return outputs

    def drop_cached_prefixes(self) -> None:
        """Forget every prefix-cache hash (their KV was computed with other weights or lost)."""
        assert not self.has_started(), "prefix caches are dropped only when nothing runs"
        self.block_manager.reset_prefix_cache()

    def reset_after_worker_loss(self) -> None:
        """After :meth:`fail_all` and a repair of the workers, whose per-request state and caches are
        gone: drop prefix hashes and the state kept about what the workers know."""
        self.scheduler.forget_workers_state()
        self.block_manager.reset_prefix_cache()
        if self.speculator is not None:
            self.speculator.reset()

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with ``finish_reason="error"`` (e.g. a worker died)."""
        outputs = []
        for request_id, tracked in list(self.requests.items()):
            request = tracked.request
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            del self.requests[request_id]
            outputs.append(RequestOutput(request_id, [], "", [], True, "error",
                                         request.num_prompt_tokens, request.num_output_tokens, error=message))
        return outputs
