"""Coordinator: one Ray actor per model replica (one tensor-parallel group).

It owns the tokenizer, the engine core (scheduler, block manager, detokenizers) and the worker
group, runs the asyncio engine loop (``schedule -> execute on all ranks -> update``), and serves
the gRPC API from the same event loop. The blocking step runs in a thread so requests can be
added and cancelled while the ranks compute; the core is only touched from the loop thread.
If a rank or the draft worker dies, every in-flight request ends with an error at once, the
replica reports itself unhealthy and repairs its workers in place (``cluster/replica/recovery.py``); a
weight reload swaps changed tensors between steps (``cluster/replica/weight_swap.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.dp_engine import make_engine
from shardserve.cluster.engine.engine import RequestOutput
from shardserve.cluster.replica.cache_events import CacheEventHub
from shardserve.cluster.engine.grammar import num_live_grammars
from shardserve.cluster.replica.recovery import probe_workers, repair_replica
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.engine.scheduler import SchedulerConfig
from shardserve.cluster.frontend.limits import TOKENIZER_THREADS, run_tokenizer
from shardserve.cluster.frontend.security import FrontConfig, key_digest
from shardserve.cluster.frontend.structured import GrammarCompiler
from shardserve.cluster.replica.reload_guard import (
    SWAP_ALLOWANCE_S, ReloadRefused, allowed_root, checkpoint_under_root, cluster_reload_lock, lock_name)
from shardserve.cluster.tokenizer import encode_chat, encode_prompt, eos_token_ids, load_tokenizer
from shardserve.cluster.replica.weight_swap import ReloadResult, check_mode, check_replacement, swap_weights
from shardserve.cluster.replica.worker_group import DraftSpec, GroupConfig, WorkerDiedError, WorkerGroup
from shardserve.workers.checkpoint_compat import CheckpointManifest
from shardserve.workers.model_source import load_config, model_context_length, resolve_model

logger = logging.getLogger(__name__)
LIVENESS_PERIOD_S = 2.0   # when idle, check the workers this often (a death is found before a request fails)
GRAMMAR_COMPILE_TIMEOUT_S = 60.0   # a structured-output constraint compiling longer is refused
# Async scheduling sends a step ahead only while steps are shorter than this (rank 0's compute, s):
# a step sent ahead was planned before the one in flight ended, so a request arriving meanwhile waits
# for both, one whole step more of TTFT. Sending ahead hides the coordinator's round trip (~2 ms per
# CPU step), under 4 % of a step beyond 50 ms, while the extra wait was a 250-600 ms step at 32
# clients on a CPU rank (issue 30).
PIPELINE_MAX_STEP_S = 0.05


class ReplicaUnavailable(RuntimeError):
    """The replica lost a shard worker and cannot serve (it may be repairing itself)."""


class RequestAborted(RuntimeError):
    """The request was ended by a weight reload with ``mode="abort"``."""


class QueueFull(RuntimeError):
    """Admission control: ``max_queued_requests`` requests already wait on this replica."""


_DEADLINE = object()   # put in a request's output queue when its deadline passes


class DeadlineExceeded(TimeoutError):
    """The request passed its deadline; it was aborted and its blocks freed."""


class Coordinator:
    """Engine loop + gRPC server of one replica (use as ``ray.remote(Coordinator)``).

    Args:
        args: engine arguments (model, cache, scheduler budgets, TP size and split).
        group: placement/communication of the shard workers.
        front: what the gRPC server enforces (API keys, TLS, admission, request timeout).

    When created inside a placement group, shard worker i uses bundle ``i + 1`` of it (bundle 0
    is the coordinator's own) and the MTP draft worker (``args.speculative_tokens > 0``) shares
    rank 0's; otherwise the worker group makes its own placement group.
    """

    def __init__(self, args: EngineArgs, group: GroupConfig | None = None, front: FrontConfig | None = None) -> None:
        import ray
        from ray.util import get_current_placement_group

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args.validate()   # refuses MTP with DP attention (cluster/dp_attention_args.py)
        # The router's credential to this replica: made here, handed over by status() (Ray), never
        # in init args, logs or metrics. Only its digest is kept for checking.
        self.internal_token = secrets.token_urlsafe(32)
        self.front = dataclasses.replace(front or FrontConfig(), internal_digest=key_digest(self.internal_token))
        self.args = args
        self.files = resolve_model(args.model)
        self.started_files = self.files   # what the app serves: the default reload root and the lock's name
        self.hf_config = args.model_config(load_config(self.files))
        args.check_model_limits(self.hf_config)
        self.tokenizer = load_tokenizer(self.files)
        group = group or GroupConfig(tensor_parallel_size=args.tensor_parallel_size)
        group.tensor_parallel_size = args.tensor_parallel_size
        self.group_config = group
        pg = get_current_placement_group()
        draft = (DraftSpec(args.draft_buffer_sizes(), args.seed, args.device, args.dtype)
                 if args.speculative_tokens else None)
        self.group = WorkerGroup(
            self.files, self.hf_config, args.runner_config(), group, args.max_num_batched_tokens, args.max_num_seqs,
            placement=(pg, 1) if pg is not None else None, draft=draft)
        try:
            max_len = args.fit_max_model_len(model_context_length(self.hf_config),
                                             self.group.num_blocks)
        except ValueError:
            self.group.shutdown()
            raise
        self.drafter, speculator = self.group.drafter, None
        if self.drafter is not None:
            from shardserve.cluster.engine.speculative import Speculator

            speculator = Speculator(self.drafter, args.speculative_tokens, args.speculative_policy)
        eos_ids = eos_token_ids(self.tokenizer, self.hf_config)
        on_cpu = all(info["memory"]["device"] == "cpu" for info in self.group.rank_info)
        budgets = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                                  max_prefill_tokens=args.prefill_budget(on_cpu))
        self.core = make_engine(args.attention_groups, self.group, self.tokenizer, self.group.num_blocks,
                                args.block_size, budgets, eos_ids, self.hf_config.vocab_size,
                                args.enable_prefix_caching, speculator=speculator,
                                num_state_slots=self.group.num_state_slots,
                                grammar_compiler=GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, eos_ids))
        self.cache_events = CacheEventHub(self.core.block_manager)   # the router's view of the prefix cache
        self.healthy, self.error = True, None
        self.recovering, self.failed = False, None     # failed: why the replica gave up (Serve replaces it)
        self.worker_restarts, self.weights_version = 0, 1
        shapes = {name: shape for info in self.group.rank_info + ([self.drafter.info] if self.drafter else [])
                  for name, shape in info["shapes"].items()}
        self.served = CheckpointManifest.from_config(self.files.path, self.hf_config, shapes)
        self.worker_status: list[dict] = []            # last answer of every worker process (ModelInfo)
        self.step_stats = {"steps": 0, "step_s": 0.0, "execute_s": 0.0, "collective_s": 0.0}
        self.steps_sent_ahead = 0                      # steps sent before the previous one was read
        self._last_execute_s = 0.0   # rank 0's compute in the last step (PIPELINE_MAX_STEP_S)
        self._queues: dict[str, asyncio.Queue] = {}
        self._group_of: dict[str, str] = {}            # request id -> client request (router's group id)
        self._group_calls: collections.Counter = collections.Counter()   # group -> calls not finished
        self._pending_tokenize = 0                     # tokenizations queued or running
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_lock: asyncio.Lock | None = None
        self._boundary_waiters = 0   # callers of _at_step_boundary waiting for the lock
        self._reload_lock: asyncio.Lock | None = None
        self._grpc = None
        self._node_ip = ray.util.get_node_ip_address()
        self._node_id = ray.get_runtime_context().get_node_id()
        self.draining = False   # being replaced (drain()): in-flight requests finish, new ones are refused
        logger.info("replica ready: %s, TP=%d (%s, %s%s), %d KV blocks", self.files.name, args.tensor_parallel_size,
                    self.group.collective, group.dispatch, ", async scheduling" if self._pipelined else "",
                    self.group.num_blocks)

    # -- engine loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup, self._step_lock, self._reload_lock = asyncio.Event(), asyncio.Lock(), asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _has_work(self) -> bool:
        # While a reload drains, fresh requests wait: only started ones are work.
        return self.core.has_started() if not self.core.scheduler.admit_new else self.core.has_unfinished()

    async def _run(self) -> None:
        while self.healthy:
            if not self._has_work():
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), LIVENESS_PERIOD_S)
                except asyncio.TimeoutError:
                    await self._check_workers()
                continue
            async with self._step_lock:
                await self._run_steps()

    @property
    def _pipelined(self) -> bool:
        """Async scheduling is on: actor-call dispatch, and no speculation or an adaptive one, which
        is pipelined while it drafts nothing (:meth:`_may_send_ahead`)."""
        speculator = self.core.speculator
        return self.group.can_pipeline and (speculator is None or speculator.policy.name == "adaptive")

    def _may_send_ahead(self, in_flight) -> bool:
        """Whether the next step may be sent before the last one in flight is read. With MTP, not
        after a step that verifies drafts (how many it accepts decides the next positions) or keeps
        its hidden states for a draft pass (the next step verifies what that pass drafts): an
        adaptive policy that has gone cold decodes with async scheduling like no speculation at all,
        instead of paying the round trip on every step for drafts it does not make (issue 31). And
        only while rank 0's last step computed for less than :data:`PIPELINE_MAX_STEP_S`."""
        if not self._pipelined or self._last_execute_s >= PIPELINE_MAX_STEP_S:
            return False
        if self.core.speculator is None or not in_flight:
            return True
        plan = in_flight[-1][0].plan
        return not plan.return_hidden and not any(s.num_spec_tokens for s in plan.scheduled)

    async def _run_steps(self) -> None:
        """Run engine steps (``schedule -> execute on all ranks -> update``, then MTP drafting) until
        there is no work, the replica failed, or someone waits for a step boundary
        (:meth:`_at_step_boundary`); returns with no step in flight. Step lock held by the caller.

        With async scheduling (vLLM's ``--async-scheduling``, :attr:`_pipelined`) the next step is
        scheduled and sent before the running one's result is read, so rank 0 starts it as soon as
        it is done instead of idling through the round trip (result back, update, schedule, plan
        out; about 2 ms per CPU decode step, ``benchmarks/bench_tp.py``). A decode whose token is
        still being sampled gets a placeholder that rank 0 fills with its own sample. Only while
        steps are short (:meth:`_may_send_ahead`): a request arriving during a long step would
        otherwise wait for the step sent ahead too."""
        in_flight: collections.deque[list] = collections.deque()   # [batch, submitted, started]
        while True:
            nothing_to_run = False
            ready = not in_flight or (len(in_flight) < 2 and self._may_send_ahead(in_flight))
            if ready and self.healthy and not self._boundary_waiters and self._has_work():
                batch = self.core.schedule()
                nothing_to_run = not batch.plan.scheduled
                if not nothing_to_run:
                    try:
                        in_flight.append([batch, self.group.submit(batch.plan), time.perf_counter()])
                    except WorkerDiedError as exc:
                        await self._fail(str(exc))
                        return
                    if len(in_flight) > 1:
                        self.steps_sent_ahead += 1
                    elif self._may_send_ahead(in_flight):
                        continue   # send the next one before reading this one
            if not in_flight:
                if nothing_to_run:   # work, but none schedulable now (e.g. no free blocks)
                    await asyncio.sleep(0.001)
                return
            batch, submitted, started = in_flight.popleft()
            try:
                result = await self.group.collect_async(submitted)
            except WorkerDiedError as exc:
                await self._fail(str(exc))   # a step sent ahead failed with it: fail_all covers both
                return
            self._record_step(time.perf_counter() - started, result)
            self._publish(self.core.update(batch, result))
            if in_flight:
                in_flight[0][2] = time.perf_counter()   # the step sent ahead starts when this one is back
            if self.core.speculator is not None:   # draft the next step's tokens
                self.core.speculator.observe_step(batch, time.perf_counter() - started)
                try:
                    await self.core.speculator.propose_async(self.core, batch, result)
                    self.drafter.check_alive()     # it may not have been called (a cold policy)
                except WorkerDiedError as exc:
                    await self._fail(str(exc))
                    return

    @contextlib.asynccontextmanager
    async def _at_step_boundary(self):
        """Hold the step lock with no step in flight: the pipelined loop stops sending steps ahead,
        collects the one in flight and lets go (weight reloads, probes, liveness checks)."""
        self._boundary_waiters += 1
        try:
            async with self._step_lock:
                yield
        finally:
            self._boundary_waiters -= 1

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self.cache_events.flush()

    def _record_step(self, wall_s: float, result) -> None:
        self._last_execute_s = result.execute_s
        stats = self.step_stats
        stats["steps"] += 1
        stats["step_s"] += wall_s                      # coordinator's round trip to all ranks
        stats["execute_s"] += result.execute_s         # rank 0 inside execute
        stats["collective_s"] += result.collective_s   # rank 0 inside all-reduce / all-gather

    def take_step_stats(self) -> dict:
        """Totals since the last call (seconds): ``steps``, ``step_s`` (dispatch round trip; with async
        scheduling the time from the previous step's result to this one's),
        ``execute_s`` (rank 0 compute incl. collectives), ``collective_s``; then reset."""
        stats, self.step_stats = self.step_stats, dict.fromkeys(self.step_stats, 0.0)
        return stats

    async def _check_workers(self) -> None:
        """Idle-time liveness check: every worker answers ``status`` (kept for ModelInfo), or the
        replica fails and repairs itself before a request runs into the dead rank."""
        async with self._at_step_boundary():
            if not self.healthy or self._has_work():
                return
            try:
                self.worker_status = await asyncio.to_thread(probe_workers, self.group, self.drafter)
            except WorkerDiedError as exc:
                await self._fail(str(exc))

    async def _fail(self, message: str) -> None:
        """End every request with an error and report unhealthy; then repair in place, or give up
        (``--recovery-timeout 0``, or the repair failed) and let Serve replace the replica."""
        logger.error("replica unhealthy: %s", message)
        self.healthy, self.error = False, message
        self._publish(self.core.fail_all(message))
        if self._grpc is not None:
            self._grpc.set_serving(False)
        if self.args.recovery_timeout > 0 and await self._recover(message):
            return
        self.failed = self.failed or f"a worker died and in-place recovery is off: {message}"
        await asyncio.to_thread(self._stop_workers)

    async def _recover(self, cause: str) -> bool:
        """Repair the workers in place (``cluster/replica/recovery.py``); True when healthy again."""
        self.recovering = True
        deadline = time.monotonic() + self.args.recovery_timeout
        try:
            while True:
                try:
                    report = await asyncio.to_thread(repair_replica, self.group, self.drafter,
                                                     max(0.1, deadline - time.monotonic()))
                    break
                except WorkerDiedError as exc:   # a worker died during the repair: repair again, in time
                    if time.monotonic() >= deadline:
                        raise
                    logger.warning("a worker failed during the repair (%s); repairing again", exc)
        except Exception as exc:  # noqa: BLE001 - any other failure: give up, Serve's health check takes over
            logger.error("in-place recovery failed (%s: %s); the replica reports itself failed",
                         type(exc).__name__, exc)
            self.failed = f"in-place recovery failed: {type(exc).__name__}: {exc} (after: {cause})"
            return False
        finally:
            self.recovering = False
        self.core.reset_after_worker_loss()
        self.cache_events.flush()
        self.worker_restarts += report.restarted
        self.weights_version += report.files_changed
        try:   # ModelInfo lists the new workers at once
            self.worker_status = await asyncio.to_thread(probe_workers, self.group, self.drafter)
        except WorkerDiedError:
            self.worker_status = []   # the idle check fails the replica again
        self.healthy, self.error = True, None
        if self._grpc is not None:
            self._grpc.set_serving(True)
        logger.warning("replica repaired in place in %.1f s: %d worker(s) restarted (shard ranks %s%s); cause: %s",
                       report.seconds, report.restarted, report.dead_ranks,
                       ", draft worker" if report.draft_restarted else "", cause)
        return True

    def check_health(self) -> None:
        """Serve's health check (through the replica): healthy, or repairing itself in place.

        Raises:
            RuntimeError: the replica gave up (Serve then replaces it).
        """
        if self.failed:
            raise RuntimeError(self.failed)

    def _stop_workers(self) -> None:
        self.group.shutdown()   # the draft worker too

    # -- weight reload ------------------------------------------------------------------------------
    async def reload_weights(self, model: str | None = None, mode: str | None = None) -> dict:
        """Hot-swap the weights that changed (``cluster/replica/weight_swap.py``): validate ``model``
        (default: the served files, changed on disk), pause admission at a step boundary, wait
        for running requests (``mode="drain"``) or end them (``"abort"``; requests that have not
        produced output yet are recomputed later instead), swap on every rank, drop every cache
        computed with the old weights, resume.

        ``model`` must lie under ``front.allowed_model_root`` (default: the served model's folder,
        see :mod:`cluster.replica.reload_guard`); the reload holds the cluster's reload lock and
        drains for at most ``front.reload_drain_timeout`` seconds.

        Returns:
            :class:`ReloadResult` as a dict.

        Raises:
            ValueError: unknown mode, or :class:`InvalidCheckpoint` (outside the allowed root, or
                unfit; nothing was changed).
            ReloadRefused: another reload holds the lock, or the drain timed out (nothing was changed).
            ReplicaUnavailable: the replica is unhealthy or a worker died meanwhile.
        """
        mode = check_mode(mode)
        if not self.healthy:
            raise ReplicaUnavailable(self.error)
        self._ensure_loop()
        # NOTE: shielded: a caller that goes away (client disconnect) must not stop a reload half-way;
        # it runs to the end and resumes admission itself.
        return await asyncio.shield(asyncio.ensure_future(self._reload(model, mode)))

    async def _reload(self, model: str | None, mode: str) -> dict:
        if self._reload_lock.locked():
            raise ReloadRefused("a reload of this replica is in progress; retry when it is done")
        async with self._reload_lock:
            started = time.monotonic()
            path = str(self.files.path) if model is None else await asyncio.to_thread(
                checkpoint_under_root, model, allowed_root(self.started_files, self.front.allowed_model_root))
            files, _ = await asyncio.to_thread(check_replacement, self.served, path)
            ttl = self.front.reload_drain_timeout + SWAP_ALLOWANCE_S
            async with cluster_reload_lock(lock_name(self.started_files.path), f"replica on {self._node_ip}", ttl):
                return await self._reload_locked(files, mode, started)

    async def _reload_locked(self, files, mode: str, started: float) -> dict:
        """Pause admission, drain or abort, swap, resume (the cluster's reload lock held)."""
        self.core.scheduler.admit_new = False
        try:
            aborted = await self._quiesce(mode)
            async with self._at_step_boundary():
                if not self.healthy:
                    raise ReplicaUnavailable(self.error)
                changed, unchanged = await self._swap(files)
        finally:
            self.core.scheduler.admit_new = True
            self._wakeup.set()
        result = ReloadResult(len(changed), len(unchanged), round(time.monotonic() - started, 3),
                              self.weights_version, aborted)
        logger.info("weights reloaded from %s (%s): %s", files.path, mode, result)
        return result.as_dict()

    async def _quiesce(self, mode: str) -> int:
        """With admission paused: end started requests (abort) or wait for them (drain), at most
        ``front.reload_drain_timeout`` seconds.

        Raises:
            ReloadRefused: requests still run at the timeout (nothing was changed).
        """
        aborted = 0
        if mode == "abort":
            async with self._at_step_boundary():
                outputs = self.core.interrupt_started("aborted: the replica is reloading its weights (mode=abort)")
                self._publish(outputs)
                aborted = len(outputs)
        deadline = time.monotonic() + self.front.reload_drain_timeout
        while self.healthy and self.core.has_started():
            if time.monotonic() > deadline:
                raise ReloadRefused(f"requests still ran after --reload-drain-timeout "
                                    f"{self.front.reload_drain_timeout:g} s; the weights were not changed (retry, "
                                    "or reload with mode=abort)")
            await asyncio.sleep(0.005)
        return aborted

    async def _swap(self, files) -> tuple[set[str], set[str]]:
        """Stage and commit on every weight holder, then drop the prefix cache (step lock held)."""
        holders = [self.group] + ([self.drafter] if self.drafter is not None else [])
        try:
            changed, unchanged = await asyncio.to_thread(swap_weights, holders, files)
        except WorkerDiedError as exc:
            await self._fail(str(exc))
            raise ReplicaUnavailable(f"a worker died during the weight reload: {exc}") from exc
        self.core.drop_cached_prefixes()
        self.cache_events.flush()
        self.files, self.served.path = files, files.path
        self.weights_version += bool(changed)
        return changed, unchanged

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, text: str | None = None, chat: list[dict] | None = None) -> list[int]:
        """Prompt ids of a raw text or a chat (blocking). Raises ValueError on a malformed prompt."""
        if chat is not None:
            return encode_chat(self.tokenizer, chat)
        if not text:
            raise ValueError("prompt must not be empty")
        return encode_prompt(self.tokenizer, text)

    async def encode_async(self, text: str | None = None, chat: list[dict] | None = None) -> list[int]:
        """:meth:`encode` on the tokenizer threads (:func:`cluster.frontend.limits.run_tokenizer`),
        so a long prompt never stalls the engine loop.

        Raises:
            ValueError: a malformed prompt.
            QueueFull: ``front.max_queued_requests`` tokenizations already wait (besides the running ones).
        """
        return await self.on_tokenizer(self.encode, text, chat)

    async def on_tokenizer(self, fn, *args):
        """``fn(*args)`` (a tokenizing job: rendering a chat, encoding) on the tokenizer threads,
        counted against the same queue as :meth:`encode_async`.

        Raises:
            QueueFull: ``front.max_queued_requests`` tokenizations already wait (besides the running ones).
        """
        if self._pending_tokenize >= self.front.max_queued_requests + TOKENIZER_THREADS:
            raise QueueFull(f"{self._pending_tokenize} prompts are being tokenized on this replica "
                            f"(--max-queued-requests {self.front.max_queued_requests}); retry later")
        self._pending_tokenize += 1
        try:
            return await run_tokenizer(fn, *args)
        finally:
            self._pending_tokenize -= 1

    def _admit(self, group: str | None) -> None:
        """Admission control over requests, not choices: the calls of one client request (the
        router's ``group``) count once, and at most ``front.limits.max_choices`` of them run.

        Raises:
            QueueFull: ``front.max_queued_requests`` requests already wait.
            ValueError: the group already has ``max_choices`` calls.
        """
        if group is not None and self._group_calls[group]:
            if self._group_calls[group] >= self.front.limits.max_choices:
                raise ValueError(f"a request may have at most {self.front.limits.max_choices} choices")
            return   # a sibling choice was admitted already
        waiting = len({self._group_of.get(r.request_id, r.request_id) for r in self.core.scheduler.waiting})
        if waiting >= self.front.max_queued_requests:
            raise QueueFull(f"{waiting} requests already wait on this replica (--max-queued-requests "
                            f"{self.front.max_queued_requests}); retry later")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       deadline: float | None = None, cache_seed: int = 0,
                       group: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the iteration early (client cancelled) or passing
        ``deadline`` (event-loop time, e.g. ``loop.time() + 30``) aborts it and frees its blocks.
        ``cache_seed``: its prefix-cache salt (:func:`cluster.engine.block_manager.cache_seed`);
        ``group``: the client request this call is one choice of (admission counts it once).

        Raises:
            ValueError: invalid request (before anything is yielded).
            QueueFull: ``front.max_queued_requests`` requests already wait (before anything is yielded).
            DeadlineExceeded: ``deadline`` passed (before or during the stream).
            ReplicaUnavailable: a shard worker died (before or during the stream).
            RequestAborted: a weight reload with ``mode="abort"`` ended it.
        """
        if not self.healthy:
            raise ReplicaUnavailable(self.error)
        if self.draining:
            raise ReplicaUnavailable("draining: this replica is being replaced; retry on another")
        self._admit(group)
        self._ensure_loop()
        compiled = None
        if params.structured_outputs is not None:   # off the event loop (cached per constraint)
            self.core.validate(prompt_ids, params)
            compiled = await self._compile(params, deadline)
        rid = self.core.add_request(prompt_ids, params, request_id, cache_seed=cache_seed, compiled_grammar=compiled)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        if group is not None:
            self._group_of[rid] = group
            self._group_calls[group] += 1
        self._wakeup.set()
        # One timer for the whole request (not a wait_for per token: a task and a timer handle each).
        timer = None if deadline is None else asyncio.get_running_loop().call_at(deadline, queue.put_nowait, _DEADLINE)
        try:
            while True:
                out = await queue.get()
                if out is _DEADLINE:
                    raise DeadlineExceeded("the request passed its deadline and was aborted")
                if out.finish_reason == "error":
                    raise ReplicaUnavailable(out.error)
                if out.finish_reason == "abort" and out.error:
                    raise RequestAborted(out.error)
                yield out
                if out.finished:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._queues.pop(rid, None)
            self.core.abort(rid)  # no-op when it finished normally
            if self._group_of.pop(rid, None) is not None:
                self._group_calls[group] -= 1
                if not self._group_calls[group]:
                    del self._group_calls[group]

    async def _compile(self, params: SamplingParams, deadline: float | None):
        """The request's compiled grammar, from the compile pool, within ``GRAMMAR_COMPILE_TIMEOUT_S``
        (and the request's deadline).

        Raises:
            ValueError: it does not compile, or not in time (message starts ``structured_outputs:``).
            DeadlineExceeded: the request's deadline passed first.
        """
        limit = GRAMMAR_COMPILE_TIMEOUT_S
        if deadline is not None:
            limit = min(limit, deadline - asyncio.get_running_loop().time())
        try:
            return await asyncio.wait_for(self.core.grammar_compiler.compile_async(params.structured_outputs), limit)
        except TimeoutError:
            if limit < GRAMMAR_COMPILE_TIMEOUT_S:
                raise DeadlineExceeded("the request passed its deadline and was aborted") from None
            raise ValueError(f"structured_outputs: the constraint did not compile within "
                             f"{GRAMMAR_COMPILE_TIMEOUT_S:g} s; simplify it") from None

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        """Whole completion (Ray-callable): ``{"token_ids", "text", "finish_reason", "logprobs"}``."""
        token_ids, text, logprobs, reason = [], "", [], None
        async for out in self.generate(prompt_ids, params):
            token_ids += out.new_token_ids
            text += out.new_text
            logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
            reason = out.finish_reason
        return {"token_ids": token_ids, "text": text, "finish_reason": reason, "logprobs": logprobs}

    async def prompt_logits(self, prompt_ids: list[int]):
        """Last-position logits of ``prompt_ids`` (``[vocab]`` float32, from rank 0), run between
        engine steps (tests and debugging)."""
        self._ensure_loop()
        async with self._at_step_boundary():
            plan, probe = self.core.probe_plan(prompt_ids)
            try:
                result = await asyncio.to_thread(self.group.execute, plan)
            finally:
                self.core.release_probe(probe)
        return getattr(result, "results", [result])[0].logits[0]   # data-parallel attention: group 0's

    # -- status -----------------------------------------------------------------------------------
    def model_info(self) -> dict:
        """What the replica serves and how loaded it is (also the gRPC ModelInfo answer)."""
        bm = self.core.block_manager
        return {
            "model": self.files.name, "architecture": self._architecture(),
            "max_model_len": self.core.max_model_len, "vocab_size": self.hf_config.vocab_size,
            "tensor_parallel_size": self.args.tensor_parallel_size, "tensor_split": self.args.tensor_split or [],
            "block_size": bm.block_size, "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "attention_dp_size": self.args.attention_groups, "kv_capacity_tokens": bm.num_blocks * bm.block_size,
            "num_running": len(self.core.scheduler.running), "num_waiting": len(self.core.scheduler.waiting),
            "healthy": self.healthy, "collective": self.group.collective, "dispatch": self.group_config.dispatch,
            "step_transport": self.group.step_transport,
            **(self.core.speculator.stats.as_dict() if self.core.speculator else {"speculative_tokens": 0}),
            "weights_version": self.weights_version, "worker_restarts": self.worker_restarts,
            "recovering": self.recovering, "admission_paused": not self.core.scheduler.admit_new,
            "prefix_cache_hit_tokens": bm.prefix_hits,
            "workers": [{"role": "coordinator", "rank": 0, "pid": os.getpid(), "bundle_index": 0, "weight_loads": 0}]
            + [{key: w[key] for key in ("role", "rank", "pid", "bundle_index", "weight_loads")}
               for w in self.worker_status],
            **self.placement(), "draining": self.draining,
            "async_scheduling": self._pipelined, "steps_sent_ahead": self.steps_sent_ahead,
            "num_preemptions": self.core.scheduler.num_preemptions,
            "num_grammar_matchers": num_live_grammars(),
        }

    def placement(self) -> dict:
        """Where the replica runs: ``coordinator_node``, ``rank_nodes`` / ``rank_node_ips`` (Ray node
        id / IP of each rank, rank order) and ``num_nodes`` (distinct nodes of all of them)."""
        rank_nodes = [node for node, _ in self.group.rank_nodes]
        return {"coordinator_node": self._node_id, "rank_nodes": rank_nodes,
                "rank_node_ips": [ip for _, ip in self.group.rank_nodes],
                "num_nodes": len({self._node_id, *rank_nodes})}

    def speculative_metrics(self) -> str:
        """MTP acceptance counters in Prometheus text format (empty when speculation is off)."""
        return self.core.speculator.stats.prometheus_text(self.files.name) if self.core.speculator else ""

    def _architecture(self) -> str:
        from shardserve.workers.models.registry import model_class

        return model_class(self.hf_config).__name__

    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.group.rank_info]

    def memory_plans(self) -> list[str]:
        """Each rank's start-up memory plan (``workers/plan.py``; ``shardserve plan`` prints the same)."""
        return [info["memory"]["plan"] for info in self.group.rank_info]

    async def start_grpc(self, port: int = 50051, host: str = "127.0.0.1") -> str:
        """Start the gRPC server on this actor's event loop; returns ``host:port`` to dial (this
        node's IP when bound to all interfaces)."""
        from shardserve.cluster.replica.grpc_server import start_grpc_server

        self._ensure_loop()
        if self._grpc is None:
            self._grpc = await start_grpc_server(self, host, port, self.front)
        return f"{self._node_ip if host in ('0.0.0.0', '::', '') else host}:{self._grpc.port}"

    @property
    def local_address(self) -> str | None:
        """Socket path of the local link (``GenerateStream`` for routers on this machine,
        ``cluster/replica/local_link.py``); None before :meth:`start_grpc`."""
        return self._grpc.local_address if self._grpc is not None else None

    async def drain(self, timeout_s: float) -> int:
        """Stop taking requests (new ones get UNAVAILABLE, gRPC health turns NOT_SERVING, so
        routers send them elsewhere) and wait until the running ones finish, at most ``timeout_s``.

        Returns:
            How many requests were still unfinished at the deadline (0: drained).
        """
        self.draining = True
        if self._grpc is not None:
            self._grpc.set_serving(False)
        deadline = time.monotonic() + timeout_s
        while self._queues and self.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._queues:
            logger.warning("drain: %d request(s) still running after %.0f s", len(self._queues), timeout_s)
        return len(self._queues)

    async def shutdown(self) -> None:
        """Stop serving, stop the ranks, release the placement group and shared memory."""
        if self._grpc is not None:
            await self._grpc.stop()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.core.grammar_compiler.shutdown()
        await asyncio.to_thread(self._stop_workers)


def default_cpus_per_worker(tensor_parallel_size: int) -> float:
    """Cores of this machine shared evenly by the ranks (at least one each)."""
    return float(max(1, (os.cpu_count() or 1) // max(1, tensor_parallel_size)))   # 0 is rejected by validate()


def launch_coordinator(args: EngineArgs, group: GroupConfig, name: str | None = None,
                       front: FrontConfig | None = None):
    """Reserve a placement group (bundle 0: coordinator, bundles 1..N: shard workers; the MTP draft
    worker, when ``args.speculative_tokens > 0``, shares bundle 1) and start a coordinator actor in it.

    Returns:
        ``(actor handle, placement group)``; the caller removes the group when done.

    Raises:
        TimeoutError: the cluster cannot fit the bundles within 120 s.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker_bundle = {"CPU": group.cpus_per_worker, **({"GPU": group.gpus_per_worker} if group.gpus_per_worker else {})}
    num_workers = args.tensor_parallel_size
    pg = placement_group([{"CPU": 1.0}] + [dict(worker_bundle) for _ in range(num_workers)],
                         strategy=group.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        raise TimeoutError(f"the Ray cluster cannot fit 1 + {num_workers} bundles ({worker_bundle} per shard worker)")
    options = {"num_cpus": 1.0, "max_concurrency": 1000,
               "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)}
    if name:
        options["name"] = name
    handle = ray.remote(Coordinator).options(**options).remote(args, group, front)
    return handle, pg


def stop_coordinator(handle, pg, timeout_s: float = 30.0) -> None:
    """Undo :func:`launch_coordinator`: shut the coordinator down (its gRPC server, ranks and shared
    memory; an actor already dead is fine), kill it and remove its placement group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - shutting down anyway (e.g. the actor died)
        pass
    ray.kill(handle)
    remove_placement_group(pg)
