"""Coordinator: one Ray actor per model replica (one tensor-parallel group).

It owns the tokenizer, the engine core (scheduler, block manager, detokenizers) and the worker
group, runs the asyncio engine loop (``schedule -> execute on all ranks -> update``), and serves
the gRPC API from the same event loop. The blocking step runs in a thread so requests can be
added and cancelled while the ranks compute; the core is only touched from the loop thread.
If a rank dies, every in-flight request ends with an error at once and the replica reports
itself unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine import EngineCore, RequestOutput
from shardserve.cluster.request import SamplingParams
from shardserve.cluster.scheduler import SchedulerConfig
from shardserve.cluster.security import FrontConfig
from shardserve.cluster.tokenizer import encode_chat, encode_prompt, eos_token_ids, load_tokenizer
from shardserve.cluster.worker_group import GroupConfig, RemoteDrafter, WorkerDiedError, WorkerGroup
from shardserve.workers.model_source import load_config, resolve_model

logger = logging.getLogger(__name__)


class ReplicaUnavailable(RuntimeError):
    """The replica lost a shard worker and cannot serve."""


class QueueFull(RuntimeError):
    """Admission control: ``max_queued_requests`` requests already wait on this replica."""


class DeadlineExceeded(TimeoutError):
    """The request passed its deadline; it was aborted and its blocks freed."""


class Coordinator:
    """Engine loop + gRPC server of one replica (use as ``ray.remote(Coordinator)``).

    Args:
        args: engine arguments (model, cache, scheduler budgets, TP size and split).
        group: placement/communication of the shard workers.
        front: what the gRPC server enforces (API keys, TLS, admission, request timeout).

    When created inside a placement group, shard worker i uses bundle ``i + 1`` of it (bundle 0
    is the coordinator's own) and the MTP draft worker (``args.speculative_tokens > 0``) bundle
    ``tensor_parallel_size + 1``; otherwise the worker group makes its own placement group.
    """

    def __init__(self, args: EngineArgs, group: GroupConfig | None = None, front: FrontConfig | None = None) -> None:
        import ray
        from ray.util import get_current_placement_group

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        args.validate()
        self.args, self.front = args, front or FrontConfig()
        self.files = resolve_model(args.model)
        self.hf_config = args.model_config(load_config(self.files))
        self.tokenizer = load_tokenizer(self.files)
        group = group or GroupConfig(tensor_parallel_size=args.tensor_parallel_size)
        group.tensor_parallel_size = args.tensor_parallel_size
        self.group_config = group
        pg = get_current_placement_group()
        self.group = WorkerGroup(
            self.files, self.hf_config, args.runner_config(), group, args.max_num_batched_tokens, args.max_num_seqs,
            placement=(pg, 1) if pg is not None else None)
        try:
            max_len = args.fit_max_model_len(getattr(self.hf_config, "max_position_embeddings", 4096),
                                             self.group.num_blocks)
        except ValueError:
            self.group.shutdown()
            raise
        self.drafter, speculator = self._start_drafter(args, group, pg), None
        if self.drafter is not None:
            from shardserve.cluster.speculative import Speculator

            speculator = Speculator(self.drafter, args.speculative_tokens)
        self.core = EngineCore(self.group, self.tokenizer, self.group.num_blocks, args.block_size,
                               SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len),
                               eos_token_ids(self.tokenizer, self.hf_config), self.hf_config.vocab_size,
                               args.enable_prefix_caching, speculator=speculator,
                               num_state_slots=self.group.num_state_slots)
        self.healthy, self.error = True, None
        self.step_stats = {"steps": 0, "step_s": 0.0, "execute_s": 0.0, "collective_s": 0.0}
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_lock: asyncio.Lock | None = None
        self._grpc = None
        self._node_ip = ray.util.get_node_ip_address()
        logger.info("replica ready: %s, TP=%d (%s, %s), %d KV blocks", self.files.name, args.tensor_parallel_size,
                    self.group.collective, group.dispatch, self.group.num_blocks)

    def _start_drafter(self, args: EngineArgs, group: GroupConfig, pg) -> RemoteDrafter | None:
        """The MTP draft worker when speculation is on (stops the shard workers if it fails)."""
        if not args.speculative_tokens:
            return None
        try:
            return RemoteDrafter(self.files, self.hf_config, args.block_size, self.group.num_blocks, group,
                                 (pg, args.tensor_parallel_size + 1) if pg is not None else None, args.seed,
                                 device=args.device, dtype=args.dtype)
        except Exception:
            self.group.shutdown()
            raise

    # -- engine loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup, self._step_lock = asyncio.Event(), asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.healthy:
            if not self.core.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._step_lock:
                batch = self.core.schedule()
                if not batch.plan.scheduled:
                    await asyncio.sleep(0.001)
                    continue
                try:
                    started = time.perf_counter()
                    result = await asyncio.to_thread(self.group.execute, batch.plan)
                    self._record_step(time.perf_counter() - started, result)
                except WorkerDiedError as exc:
                    await self._fail(str(exc))
                    return
            for out in self.core.update(batch, result):
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if self.core.speculator is not None:   # draft the next step's tokens
                async with self._step_lock:
                    try:
                        await self.core.speculator.propose_async(self.core, batch, result)
                    except WorkerDiedError as exc:
                        await self._fail(str(exc))
                        return

    def _record_step(self, wall_s: float, result) -> None:
        stats = self.step_stats
        stats["steps"] += 1
        stats["step_s"] += wall_s                      # coordinator's round trip to all ranks
        stats["execute_s"] += result.execute_s         # rank 0 inside execute
        stats["collective_s"] += result.collective_s   # rank 0 inside all-reduce / all-gather

    def take_step_stats(self) -> dict:
        """Totals since the last call (seconds): ``steps``, ``step_s`` (dispatch round trip),
        ``execute_s`` (rank 0 compute incl. collectives), ``collective_s``; then reset."""
        stats, self.step_stats = self.step_stats, dict.fromkeys(self.step_stats, 0.0)
        return stats

    async def _fail(self, message: str) -> None:
        logger.error("replica unhealthy: %s", message)
        self.healthy, self.error = False, message
        for out in self.core.fail_all(message):
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if self._grpc is not None:
            self._grpc.set_unhealthy()
        await asyncio.to_thread(self._stop_workers)

    def _stop_workers(self) -> None:
        self.group.shutdown()
        if self.drafter is not None:
            self.drafter.shutdown()

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, text: str | None = None, chat: list[dict] | None = None) -> list[int]:
        """Prompt ids of a raw text or a chat. Raises ValueError on a malformed prompt."""
        if chat is not None:
            return encode_chat(self.tokenizer, chat)
        if not text:
            raise ValueError("prompt must not be empty")
        return encode_prompt(self.tokenizer, text)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the iteration early (client cancelled) or passing
        ``deadline`` (event-loop time, e.g. ``loop.time() + 30``) aborts it and frees its blocks.

        Raises:
            ValueError: invalid request (before anything is yielded).
            QueueFull: ``front.max_queued_requests`` requests already wait (before anything is yielded).
            DeadlineExceeded: ``deadline`` passed (before or during the stream).
            ReplicaUnavailable: a shard worker died (before or during the stream).
        """
        if not self.healthy:
            raise ReplicaUnavailable(self.error)
        waiting = len(self.core.scheduler.waiting)
        if waiting >= self.front.max_queued_requests:
            raise QueueFull(f"{waiting} requests already wait on this replica (--max-queued-requests "
                            f"{self.front.max_queued_requests}); retry later")
        self._ensure_loop()
        rid = self.core.add_request(prompt_ids, params, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._wakeup.set()
        loop = asyncio.get_running_loop()
        try:
            while True:
                if deadline is None:
                    out = await queue.get()
                else:
                    try:
                        out = await asyncio.wait_for(queue.get(), deadline - loop.time())
                    except TimeoutError:
                        raise DeadlineExceeded("the request passed its deadline and was aborted") from None
                if out.finish_reason == "error":
                    raise ReplicaUnavailable(out.error)
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self.core.abort(rid)  # no-op when it finished normally

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
        async with self._step_lock:
            plan, probe = self.core.probe_plan(prompt_ids)
            try:
                result = await asyncio.to_thread(self.group.execute, plan)
            finally:
                self.core.release_probe(probe)
        return result.logits[0]

    # -- status -----------------------------------------------------------------------------------
    def model_info(self) -> dict:
        """What the replica serves and how loaded it is (also the gRPC ModelInfo answer)."""
        bm = self.core.block_manager
        return {
            "model": self.files.name, "architecture": self._architecture(),
            "max_model_len": self.core.max_model_len, "vocab_size": self.hf_config.vocab_size,
            "tensor_parallel_size": self.args.tensor_parallel_size, "tensor_split": self.args.tensor_split or [],
            "block_size": bm.block_size, "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_running": len(self.core.scheduler.running), "num_waiting": len(self.core.scheduler.waiting),
            "healthy": self.healthy, "collective": self.group.collective, "dispatch": self.group_config.dispatch,
            **(self.core.speculator.stats.as_dict() if self.core.speculator else {"speculative_tokens": 0}),
        }

    def speculative_metrics(self) -> str:
        """MTP acceptance counters in Prometheus text format (empty when speculation is off)."""
        return self.core.speculator.stats.prometheus_text() if self.core.speculator else ""

    def _architecture(self) -> str:
        from shardserve.workers.models.registry import model_class

        return model_class(self.hf_config).__name__

    def worker_pids(self) -> list[int]:
        return [info["pid"] for info in self.group.rank_info]

    async def start_grpc(self, port: int = 50051, host: str = "127.0.0.1") -> str:
        """Start the gRPC server on this actor's event loop; returns ``host:port`` to dial (this
        node's IP when bound to all interfaces)."""
        from shardserve.cluster.grpc_server import start_grpc_server

        self._ensure_loop()
        if self._grpc is None:
            self._grpc = await start_grpc_server(self, host, port, self.front)
        return f"{self._node_ip if host in ('0.0.0.0', '::', '') else host}:{self._grpc.port}"

    async def shutdown(self) -> None:
        """Stop serving, stop the ranks, release the placement group and shared memory."""
        if self._grpc is not None:
            await self._grpc.stop()
        if self._loop_task is not None:
            self._loop_task.cancel()
        await asyncio.to_thread(self._stop_workers)


def default_cpus_per_worker(tensor_parallel_size: int) -> float:
    """Cores of this machine shared evenly by the ranks (at least one each)."""
    return float(max(1, (os.cpu_count() or 1) // max(1, tensor_parallel_size)))   # 0 is rejected by validate()


def launch_coordinator(args: EngineArgs, group: GroupConfig, name: str | None = None,
                       front: FrontConfig | None = None):
    """Reserve a placement group (bundle 0: coordinator, bundles 1..N: shard workers, N + 1: the
    MTP draft worker when ``args.speculative_tokens > 0``) and start a coordinator actor in it.

    Returns:
        ``(actor handle, placement group)``; the caller removes the group when done.

    Raises:
        TimeoutError: the cluster cannot fit the bundles within 120 s.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker_bundle = {"CPU": group.cpus_per_worker, **({"GPU": group.gpus_per_worker} if group.gpus_per_worker else {})}
    num_workers = args.tensor_parallel_size + (1 if args.speculative_tokens else 0)   # + the draft worker
    pg = placement_group([{"CPU": 1.0}] + [dict(worker_bundle) for _ in range(num_workers)],
                         strategy=group.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        raise TimeoutError(f"the Ray cluster cannot fit 1 + {num_workers} bundles "
                           f"({worker_bundle} per shard or draft worker)")
    options = {"num_cpus": 1.0, "max_concurrency": 1000,
               "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)}
    if name:
        options["name"] = name
    handle = ray.remote(Coordinator).options(**options).remote(args, group, front)
    return handle, pg
