"""Spawn the tensor-parallel ShardWorker actors of one replica and drive them every step.

Placement: one bundle per rank. Inside a placement group that already exists (a Serve replica's,
or the one ``serve-grpc`` makes for the coordinator), rank i takes bundle ``i + bundle_offset``;
we never create a nested group there. With MTP speculation the draft worker shares rank 0's bundle
(a small fraction of its CPUs and GPU: it runs while rank 0 waits, on the same device, so TP=N with
MTP needs N GPUs), loads its weights and shared buffers before the ranks size their caches, and
counts its caches in rank 0's budget; rank 0 maps the buffers once (``workers/draft_buffers.py``). Otherwise a group is made here (PACK on one node by
default; SPREAD, STRICT_PACK and STRICT_SPREAD allowed). Ranks on different Ray nodes always use
the network collective (gloo on CPU, NCCL on GPU), never the shared-memory one. Dispatch: a Ray Compiled Graph (shared-memory channels, no task round
trip per step) or plain actor calls; both send the same StepPlan to every rank at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardserve.cluster.ray_errors import root_cause
from shardserve.cluster.engine.step_timer import StepTimer
from shardserve.workers.distributed import collective_kind
from shardserve.workers.draft_buffers import BufferSizes
from shardserve.workers.draft_worker import DraftWorker
from shardserve.workers.messages import (DataParallelPlan, DataParallelResult, DraftBatch, DraftResult, StepPlan,
                                         StepResult)
from shardserve.workers.model_runner import RunnerConfig
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.partition import split_units
from shardserve.workers.step_channel import connect
from shardserve.workers.worker import ShardWorker

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A shard or draft worker died or failed; the replica cannot serve until repaired."""


@dataclass(slots=True)
class GroupConfig:
    """How to place and connect the ranks."""

    tensor_parallel_size: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    strategy: str = "PACK"              # Ray placement strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    collective: str | None = None       # CPU: "shm" or "gloo"; None = pick by placement
    dispatch: str = "calls"             # "calls" (actor calls) or "compiled" (Ray Compiled Graph); as the CLI
    device: str = "auto"                # --device: "cpu" keeps CPU collectives even on GPU bundles


def check_worker_resources(cpus_per_worker: float, gpus_per_worker: float) -> None:
    """Each rank's Ray resources: CPUs > 0 and GPUs >= 0, both finite (``serve``, ``serve-grpc``,
    ``generate -tp N``, ``manifest`` and ``serve_config.yaml`` alike).

    Raises:
        ValueError: naming the setting.
    """
    if not 0 < cpus_per_worker < math.inf:
        raise ValueError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
    if not 0 <= gpus_per_worker < math.inf:
        raise ValueError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")


DRAFT_SHARE = 0.01   # of rank 0's bundle (CPUs and GPUs) reserved for the MTP draft actor
# The draft actor's OpenMP threads sleep as soon as a parallel region ends instead of spinning
# (libgomp's default spins first): it runs on rank 0's cores between two of rank 0's steps, and its
# spinning team took those cores from the next verify step. Served demo model (MTP k = 3 fixed,
# batch 1, 2-core machine, six 120-token requests): 6.14 s with spinning, 3.70 s with this,
# 4.61 s with no speculation (issue 31). A draft pass's own time barely changes (a 1-thread draft
# measured the same, 3.67 s).
DRAFT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
DRAFT_PING_S = 1.0   # while steps run, the draft actor's liveness is asked at most this often


@dataclass(slots=True)
class DraftSpec:
    """The replica's MTP draft worker (speculation on)."""

    sizes: BufferSizes       # what the buffers shared with rank 0 hold
    seed: int = 0            # seed of its generator for unseeded requests
    device: str = "auto"     # as the shard workers' --device / --dtype
    dtype: str = "auto"


def draft_resources(config: GroupConfig) -> tuple[float, float]:
    """``(CPUs, GPUs)`` of the draft actor inside rank 0's bundle (multiples of Ray's 0.0001)."""
    share = lambda amount: max(0.0001, round(amount * DRAFT_SHARE, 4)) if amount else 0.0  # noqa: E731
    return share(config.cpus_per_worker), share(config.gpus_per_worker)


class _ChannelOwner:
    """Holds a :class:`workers.step_channel.StepClient` (``_channel``, None while Ray calls carry the steps)."""

    _channel = None

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class WorkerGroup(_ChannelOwner):
    """The ranks of one model replica (and its MTP draft worker).

    Args:
        files, hf_config: the model.
        runner_config: cache and split settings, same for every rank.
        config: placement and communication.
        max_batched_tokens, max_num_seqs: sizes of the largest collective payloads (shm slots).
        placement: an existing placement group and the bundle index of rank 0 in it.
        draft: the MTP draft worker to start in rank 0's bundle (:attr:`drafter`), or None.

    Raises:
        WorkerDiedError: a rank or the draft worker failed to start (the message carries its error).
    """

    def __init__(self, files: ModelFiles, hf_config, runner_config: RunnerConfig, config: GroupConfig,
                 max_batched_tokens: int, max_num_seqs: int,
                 placement: tuple[PlacementGroup, int] | None = None, draft: DraftSpec | None = None) -> None:
        self.config = config
        if 0 < config.gpus_per_worker < 1:   # ranks sharing a GPU: each plans for its share
            runner_config = dataclasses.replace(runner_config, gpu_fraction=config.gpus_per_worker)
        self.files, self.hf_config, self.runner_config = files, hf_config, runner_config
        self._max_sizes = (max_batched_tokens, max_num_seqs)
        tp = config.tensor_parallel_size
        self._own_pg = None
        if placement is None:
            bundle = {"CPU": config.cpus_per_worker, **({"GPU": config.gpus_per_worker} if config.gpus_per_worker else {})}
            self._own_pg = placement_group([dict(bundle) for _ in range(tp)], strategy=config.strategy)
            ray.get(self._own_pg.ready(), timeout=120)
            placement = (self._own_pg, 0)
        self._placement = placement
        self._with_draft = draft is not None
        self.workers = [self._spawn(rank) for rank in range(tp)]
        self.drafter: RemoteDrafter | None = None
        self._segments: list = []   # shared-memory segments of the communicators (shm collective)
        self._dag = None
        self._channel = None   # StepClient: steps over Unix sockets (workers/step_channel.py)
        self._step_timer = StepTimer()
        configs = [runner_config] * tp
        try:
            if draft is not None:   # first: its weights and buffers are in use when rank 0 sizes its caches
                self.drafter = RemoteDrafter(files, hf_config, runner_config.block_size, config,
                                             (placement[0], self.bundle_index(0)), draft)
                configs[0] = dataclasses.replace(runner_config, draft_on_device=True)   # in rank 0's plan
            self.collective = self._init_collective()
            infos = _first_failure_get([w.load.remote(files, hf_config, c) for w, c in zip(self.workers, configs)])
        except Exception as exc:
            self.shutdown()
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ValueError):   # a bad device request or a model that does not fit: say it as is
                raise cause from None
            if isinstance(exc, WorkerDiedError):
                raise
            raise WorkerDiedError(f"shard workers failed to start: {exc}") from exc
        self.num_blocks = min(info["max_num_blocks"] for info in infos)
        self.num_state_slots = infos[0]["num_state_slots"]   # same on every rank (max_num_seqs + 1 or 0)
        try:
            cache_bytes = _first_failure_get([w.allocate_kv_cache.remote(self.num_blocks) for w in self.workers])
            if self.drafter is not None:
                self.drafter.allocate_caches(self.num_blocks)
                self.link_draft()
        except Exception as exc:
            self.shutdown()
            raise WorkerDiedError(f"shard workers failed to allocate their caches: {exc}") from exc
        for rank, (info, nbytes) in enumerate(zip(infos, cache_bytes)):
            info["cache_bytes"] = nbytes
            mem = info["memory"]
            logger.info("TP rank %d (pid %d, %s, %s): weights %.1f MiB, activations %.1f MiB, KV cache %.1f MiB in "
                        "%d blocks; plan: %s", rank, info["pid"], mem["device"], mem["dtype"], mem["weights"] / 2**20,
                        mem["activation"] / 2**20, nbytes / 2**20, self.num_blocks, mem["plan"])
        self.rank_info = infos
        if config.dispatch == "compiled":
            self._compile()
        else:
            try:
                self._open_channel()
            except Exception as exc:
                self.shutdown()
                raise WorkerDiedError(f"shard workers failed to open their step channels: {exc}") from exc

    def _open_channel(self) -> None:
        """Steps over Unix sockets to ranks on this node (``--dispatch calls``): ~25 us a step
        instead of a Ray call's ~600 us of CPU. Ray calls stay where any rank is on another node."""
        self._close_channel()
        self._channel = connect(self.workers)

    def _spawn(self, rank: int):
        """A new (not yet loaded) ShardWorker actor for ``rank`` in its own bundle (rank 0 leaves the
        draft actor its share)."""
        pg, offset = self._placement
        config = self.config
        cpus, gpus = config.cpus_per_worker, config.gpus_per_worker
        if rank == 0 and self._with_draft:
            draft_cpus, draft_gpus = draft_resources(config)
            cpus, gpus = round(cpus - draft_cpus, 4), round(gpus - draft_gpus, 4)
        return ray.remote(ShardWorker).options(
            num_cpus=cpus, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=offset + rank),
        ).remote(rank, config.tensor_parallel_size, max(1, int(config.cpus_per_worker)))

    def bundle_index(self, rank: int) -> int:
        """The placement-group bundle that rank ``rank`` (and any replacement of it) runs in."""
        return self._placement[1] + rank

    def link_draft(self, fresh: bool = False) -> None:
        """Rank 0 maps the draft worker's shared buffers (``fresh``: new ones, after rank 0 or the
        draft worker was replaced), then their name is removed.

        Raises:
            RayError: rank 0 or the draft worker failed.
        """
        handle = self.drafter.share_buffers(fresh)
        ray.get(self.workers[0].attach_draft_buffers.remote(handle))
        self.drafter.release_buffer_name()

    def _init_collective(self, timeout_s: float | None = None) -> str:
        """Form a new communicator over the current actors (a new shm segment, gloo port or NCCL id).

        Raises:
            GetTimeoutError: some rank did not answer within ``timeout_s`` (e.g. not scheduled yet).
        """
        tp = self.config.tensor_parallel_size
        hf_config, runner_config = self.hf_config, self.runner_config
        max_tokens, max_seqs = self._max_sizes
        # (node id, ip) of each rank, in rank order: picks the collective, reported by ModelInfo
        nodes = self.rank_nodes = ray.get([w.node_address.remote() for w in self.workers], timeout=timeout_s)
        if tp == 1:
            ray.get(self.workers[0].init_group.remote("none", {}), timeout=timeout_s)
            return "none"
        same_node = len({node for node, _ in nodes}) == 1
        device = "cuda" if self.config.gpus_per_worker and self.config.device != "cpu" else "cpu"
        kind = collective_kind(device, same_node, self.config.collective)
        num_groups = runner_config.attention_dp_size
        if num_groups == 1:
            vocab_slice = max(size for _, size in split_units(hf_config.vocab_size, tp, runner_config.tensor_split))
            info = self._communicator(kind, tp, max(max_tokens * hf_config.hidden_size, max_seqs * vocab_slice),
                                      nodes, timeout_s)
        else:   # data-parallel attention: one communicator over every rank (the experts), one per group
            size = tp // num_groups
            if kind == "gloo" and size > 1:
                raise ValueError("data-parallel attention with several ranks per attention group needs the shm or "
                                 "NCCL collectives (gloo forms one group per process)")
            vocab_slice = -(-hf_config.vocab_size // size)
            # rows: one group's step (runner_config holds the per-group budget). The exchanges over
            # all ranks (workers/models/group_exchange.py, moe_exchange.py) all-gather [rows, hidden]
            # and reduce-scatter [tp, rows, hidden]; alltoall sends each token (with its top-k ids
            # and weights) to at most min(k, tp) ranks; the LM head all-gathers [seqs, vocab / tp].
            rows, hidden = runner_config.max_num_batched_tokens, hf_config.hidden_size
            top_k = getattr(hf_config, "num_experts_per_tok", 1)
            max_floats = max(tp * rows * hidden, rows * min(top_k, tp) * (hidden + 2 * top_k),
                             max_seqs * -(-hf_config.vocab_size // tp))
            info = self._communicator(kind, tp, max_floats, nodes, timeout_s)
            info["attention_dp_size"] = num_groups
            if size > 1:
                info["groups"] = [self._communicator(kind, size, max(rows * hf_config.hidden_size,
                                                                     max_seqs * vocab_slice), nodes, timeout_s)
                                  for _ in range(num_groups)]
        # concurrent: ranks rendezvous
        ray.get([w.init_group.remote(kind, info) for w in self.workers], timeout=timeout_s)
        for segment in self._segments:
            segment.unlink()   # every rank has it mapped: no name left behind, however Ray stops them
        return kind

    def _communicator(self, kind: str, size: int, max_floats: int, nodes: list, timeout_s: float | None) -> dict:
        """What ``size`` ranks need to form one communicator of ``kind`` (a new shm segment holding
        ``max_floats`` per rank, a gloo rendezvous address, or an NCCL id)."""
        if kind == "shm":
            from shardserve.workers.comm_cpu import SharedMemorySegment

            segment = SharedMemorySegment(size, max_floats)
            self._segments.append(segment)
            return {"name": segment.name, "max_floats": max_floats}
        if kind == "gloo":
            port = ray.get(self.workers[0].free_port.remote(), timeout=timeout_s)
            return {"init_method": f"tcp://{nodes[0][1]}:{port}"}
        return {"unique_id": ray.get(self.workers[0].nccl_unique_id.remote(), timeout=timeout_s)}

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
        self._dag = dag.experimental_compile()

    def _answer(self, plan: StepPlan | DataParallelPlan, results: list) -> StepResult | DataParallelResult:
        """Rank 0's result, or with data-parallel attention each attention group's first rank's."""
        if not isinstance(plan, DataParallelPlan):
            return results[0]
        size = self.config.tensor_parallel_size // len(plan.plans)
        return DataParallelResult([results[group * size] for group in range(len(plan.plans))])

    def execute(self, plan: StepPlan | DataParallelPlan) -> StepResult | DataParallelResult:
        """Send ``plan`` to every rank at once; rank 0's result (:meth:`_answer`).

        Raises:
            WorkerDiedError: any rank died or raised.
        """
        return self.collect(self.submit(plan))

    @property
    def step_transport(self) -> str:
        """How plans reach the ranks: ``unix-socket`` (every rank on the coordinator's node),
        ``ray-calls`` or ``compiled-graph``."""
        if self._dag is not None:
            return "compiled-graph"
        return "unix-socket" if self._channel is not None else "ray-calls"

    @property
    def can_pipeline(self) -> bool:
        """Whether steps may be submitted before the previous one's result is read (async
        scheduling): with actor calls, which each rank runs in submission order (rank 0 fills a
        plan's placeholders and shares them with the other ranks, ``ModelRunner._share_placeholders``)."""
        return self._dag is None

    def submit(self, plan: StepPlan) -> tuple[list, StepPlan]:
        """Send ``plan`` to every rank without waiting; hand the returned handle to :meth:`collect`.

        Raises:
            WorkerDiedError: the plan could not be sent.
        """
        try:
            if self._dag is not None:
                return [self._dag.execute(plan)], plan
            if self._channel is not None:
                self._channel.send(plan)
                return [], plan
            return [w.execute.remote(plan) for w in self.workers], plan
        except Exception as exc:
            raise self._failed(exc) from exc

    def collect(self, submitted: tuple[list, StepPlan]) -> StepResult:
        """Rank 0's result of a :meth:`submit` (blocking).

        Raises:
            WorkerDiedError: any rank died or raised.
        """
        refs, plan = submitted
        try:
            if self._dag is not None:
                time.sleep(self._step_timer.sleep_s(plan))   # the result read below spins: keep it short
                result = self._answer(plan, ray.get(refs[0]))
                self._step_timer.observe(plan, result.execute_s)
                return result
            if self._channel is not None:
                return self._answer(plan, self._channel.recv())
            return self._answer(plan, _first_failure_get(refs))
        except Exception as exc:
            raise self._failed(exc) from exc

    async def collect_async(self, submitted: tuple[list, StepPlan]) -> StepResult:
        """:meth:`collect` for the coordinator's event loop: with actor calls the ranks' results are
        awaited on the loop itself (no thread hop per step); a compiled graph's read runs in a thread.

        Raises:
            WorkerDiedError: any rank died or raised.
        """
        if self._dag is not None:
            return await asyncio.to_thread(self.collect, submitted)
        refs, plan = submitted
        try:
            if self._channel is not None:
                return self._answer(plan, await self._channel.recv_async())
            # gather raises the first failure as soon as it happens (the other ranks may be blocked in
            # a collective waiting for the failed one; the caller then kills them)
            return self._answer(plan, await asyncio.gather(*refs))
        except Exception as exc:
            raise self._failed(exc) from exc

    def _abort_segments(self) -> None:
        for segment in self._segments:
            segment.abort()   # unblock ranks spinning on a dead peer

    def _failed(self, exc: Exception) -> WorkerDiedError:
        self._abort_segments()
        return WorkerDiedError(f"shard worker failed: {root_cause(exc)}")

    # -- recovery ---------------------------------------------------------------------------------
    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """Ranks whose actor died, or that do not answer within ``timeout_s`` (stuck in a collective
        with a dead peer: those are replaced too)."""
        return unresponsive([w.status.remote() for w in self.workers], timeout_s)

    def repair(self, dead: list[int], timeout_s: float) -> list[dict]:
        """Bring the group back in place after a rank failed (NOTE: no step may run meanwhile).

        Only the ``dead`` ranks get new actors, in their own bundles, and load their own slices;
        the surviving ranks keep their weights in memory, forget their requests and zero their
        caches; every rank joins a new communicator (a new shm segment, gloo rendezvous or NCCL id).

        Returns:
            the new ranks' load info (``pid``, ``weight_bytes``, ...), in ``dead`` order.

        Raises:
            TimeoutError: within ``timeout_s`` a new rank was not placed (its node is gone and Ray
                has not rescheduled the bundle yet) or did not load; the new actors are stopped.
            WorkerDiedError: a rank failed while re-forming the group.
        """
        deadline = time.monotonic() + timeout_s
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        self._teardown_dag()
        self._close_channel()
        self._abort_segments()   # survivors still spinning on the dead peer give up now
        for rank in dead:
            ray.kill(self.workers[rank], no_restart=True)
            self.workers[rank] = self._spawn(rank)
        survivors = [rank for rank in range(self.config.tensor_parallel_size) if rank not in dead]
        try:
            ray.get([self.workers[rank].leave_group.remote() for rank in survivors], timeout=left())
            self._close_segment()
            self.collective = self._init_collective(left())
            # Replacements load their slices with the group's block count (no memory profile: its
            # forward would need the survivors) and capture their decode graphs, while the survivors
            # forget their requests, zero their caches and capture theirs again (graphs hold the old
            # communicator's all-reduces): on CUDA both sides' captures run collectives together.
            config = dataclasses.replace(self.runner_config, num_blocks=self.num_blocks)
            answers = ray.get([self.workers[rank].load.remote(self.files, self.hf_config, config) for rank in dead]
                              + [self.workers[rank].rejoin.remote() for rank in survivors], timeout=left())
            infos = answers[:len(dead)]
        except GetTimeoutError as exc:
            for rank in dead:
                ray.kill(self.workers[rank], no_restart=True)
            raise TimeoutError(f"replacement of rank(s) {dead} not placed and loaded within {timeout_s:.0f} s "
                               "(is its node gone?)") from exc
        except RayError as exc:
            raise WorkerDiedError(f"repairing the group failed: {root_cause(exc)}") from exc
        for rank, info in zip(dead, infos):
            info["cache_bytes"] = info["memory"]["cache"]
            self.rank_info[rank] = info
        if self.config.dispatch == "compiled":
            self._compile()
        else:
            self._open_channel()
        return infos

    # -- weight reload (see workers/weight_reload.py) -----------------------------------------------
    def stage_reload(self, files: ModelFiles) -> list[dict]:
        """Every rank reads ``files`` and keeps the tensors that changed in its slices.

        Raises:
            CheckpointError: a rank could not read a tensor (nothing changed anywhere).
            WorkerDiedError: a rank died.
        """
        return self._call_all("stage_reload", files)

    def commit_reload(self, files: ModelFiles) -> None:
        """Every rank copies its staged tensors into its parameters and resets its caches; later
        replacements of a rank load ``files``."""
        self._call_all("commit_reload")
        self.files = files

    def discard_reload(self) -> None:
        """Every rank drops what it staged (best effort: a dead rank has nothing to drop)."""
        ray.wait([w.discard_reload.remote() for w in self.workers], num_returns=len(self.workers), timeout=30)

    def _call_all(self, method: str, *args) -> list:
        try:
            return ray.get([getattr(w, method).remote(*args) for w in self.workers])
        except RayActorError as exc:
            raise WorkerDiedError(f"shard worker died during {method}: {root_cause(exc)}") from exc

    # -- teardown ------------------------------------------------------------------------------------
    def _teardown_dag(self) -> None:
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001 - a dead actor makes teardown complain; we kill anyway
                pass
            self._dag = None

    def _close_segment(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []

    def shutdown(self) -> None:
        """Tear down the graph, stop the ranks and the draft worker, free the placement group. Idempotent."""
        self._teardown_dag()
        self._close_channel()
        self._abort_segments()
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self.drafter is not None:
            self.drafter.shutdown()
        self._close_segment()
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)
            self._own_pg = None


def unresponsive(status_refs: list, timeout_s: float) -> list[int]:
    """Indices of ``status`` calls that failed or did not answer within ``timeout_s``."""
    ready, _ = ray.wait(status_refs, num_returns=len(status_refs), timeout=timeout_s)
    done, dead = set(ready), []
    for index, ref in enumerate(status_refs):
        try:
            if ref not in done:
                raise GetTimeoutError(f"no answer within {timeout_s} s")
            ray.get(ref)
        except RayError:
            dead.append(index)
    return dead


def _first_failure_get(refs: list) -> list:
    """``ray.get(refs)``, but raising the first failure as soon as it happens: the other ranks may
    be blocked in a collective waiting for the failed one (then the caller kills them)."""
    if len(refs) == 1:
        return [ray.get(refs[0])]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)


class RemoteDrafter(_ChannelOwner):
    """The replica's DraftWorker actor (MTP draft model), in rank 0's bundle (see the module
    docstring); made by :class:`WorkerGroup`.

    Args:
        files, hf_config: the model (its MTP layer is loaded).
        block_size: the target's cache layout (the draft caches share its block ids).
        config: the group's placement (the actor takes :func:`draft_resources` of rank 0's bundle).
        placement: the placement group and rank 0's bundle index in it.
        spec: buffer sizes, seed, device and dtype.

    Raises:
        WorkerDiedError: the actor failed to start or load (e.g. the checkpoint has no MTP layer).
    """

    def __init__(self, files: ModelFiles, hf_config, block_size: int, config: GroupConfig,
                 placement: tuple[PlacementGroup, int], spec: DraftSpec) -> None:
        self.files, self.hf_config, self.block_size, self.spec = files, hf_config, block_size, spec
        self.placement, self.num_blocks = placement, 0
        cpus, gpus = draft_resources(config)
        self._options = {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement[0], placement_group_bundle_index=placement[1]),
            "runtime_env": {"env_vars": dict(DRAFT_ENV)}}   # merged with the replica's own env_vars
        self._threads = max(1, int(config.cpus_per_worker))
        self.actor = None
        self._channel = None   # StepClient: drafting passes over a Unix socket (workers/step_channel.py)
        self._ping, self._next_ping = None, 0.0   # an outstanding status call (check_alive)
        try:
            self._start(None)
        except Exception as exc:
            self.shutdown()
            raise WorkerDiedError(f"draft worker failed to start: {exc}") from exc

    def _start(self, timeout_s: float | None) -> None:
        spec = self.spec
        self.actor = ray.remote(DraftWorker).options(**self._options).remote(self._threads)
        self._ping = None
        self.info = ray.get(self.actor.load_weights.remote(self.files, self.hf_config, spec.sizes, self.block_size,
                                                           spec.dtype, spec.seed, spec.device), timeout=timeout_s)
        if self.num_blocks:
            self.allocate_caches(self.num_blocks, timeout_s)
        self._close_channel()
        self._channel = connect([self.actor], timeout_s, names=["the draft worker"])

    def allocate_caches(self, num_blocks: int, timeout_s: float | None = None) -> None:
        """The draft's caches, ``num_blocks`` blocks (the group's count)."""
        self.num_blocks = num_blocks
        self.info["cache_bytes"] = ray.get(self.actor.allocate_caches.remote(num_blocks), timeout=timeout_s)

    def share_buffers(self, fresh: bool = False) -> dict:
        """The shared buffers' handle (``fresh``: new buffers first)."""
        return ray.get(self.actor.share_buffers.remote(fresh))

    def release_buffer_name(self) -> None:
        ray.get(self.actor.release_buffer_name.remote())

    def propose(self, batch: DraftBatch) -> DraftResult:
        """Run one drafting pass on the actor.

        Raises:
            WorkerDiedError: the actor died or raised.
        """
        try:
            if self._channel is not None:
                self._channel.send(batch)
                return self._channel.recv()[0]
            return ray.get(self.actor.propose.remote(batch))
        except Exception as exc:
            raise WorkerDiedError(f"draft worker failed: {root_cause(exc)}") from exc

    def check_alive(self) -> None:
        """Between steps: raise if the actor died, without waiting. Every ``DRAFT_PING_S`` it reads
        the status call it sent last time if that has answered (a dead actor's answers at once, with
        its error) and sends another. Shard ranks are called every step, so their death shows in
        the next step; the draft actor is called only while the speculation policy drafts, and a
        draft worker killed while the policy was cold went unnoticed until the replica fell idle
        (its streams ran on; ``test_recovery_reload_v32`` expects them to fail and the replica to
        repair within 5 s, and failed once in a full run).

        Over a step channel, the actor's process dying closes its socket: that shows at once (a
        non-blocking peek), so a stream of a fast model cannot run to its end on a dead draft worker
        before two pings have gone out.

        Raises:
            WorkerDiedError: the actor died or its status call failed.
        """
        if self._channel is not None and self._channel.peer_closed():
            raise WorkerDiedError("draft worker failed: its step channel closed (did it die?)")
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + DRAFT_PING_S
        ping, self._ping = self._ping, self.actor.status.remote()
        if ping is not None and ray.wait([ping], timeout=0)[0]:
            try:
                ray.get(ping)
            except Exception as exc:
                raise WorkerDiedError(f"draft worker failed: {root_cause(exc)}") from exc

    # -- recovery and weight reload --------------------------------------------------------------------
    def is_dead(self, timeout_s: float = 10.0) -> bool:
        """Whether the actor died or does not answer within ``timeout_s``."""
        return bool(unresponsive([self.actor.status.remote()], timeout_s))

    def repair(self, dead: bool, timeout_s: float) -> bool:
        """Replace a dead actor in rank 0's bundle (it loads the MTP weights and allocates its
        caches; :meth:`WorkerGroup.link_draft` then gives rank 0 its new buffers), or have a live
        one forget its requests and zero its caches. Returns whether a new actor was started.

        Raises:
            TimeoutError: the new actor was not placed and loaded within ``timeout_s`` (stopped).
            WorkerDiedError: the actor failed.
        """
        self._close_channel()   # drafting passes it had read and not started are stale
        try:
            if not dead:
                ray.get(self.actor.reset_state.remote(), timeout=timeout_s)
                self._channel = connect([self.actor], timeout_s, names=["the draft worker"])
                return False
            ray.kill(self.actor, no_restart=True)
            self._start(timeout_s)
            return True
        except GetTimeoutError as exc:
            self.shutdown()
            raise TimeoutError(f"draft worker not placed and loaded within {timeout_s:.0f} s") from exc
        except RayError as exc:
            raise WorkerDiedError(f"draft worker failed during repair: {root_cause(exc)}") from exc

    def stage_reload(self, files: ModelFiles) -> list[dict]:
        """Like :meth:`WorkerGroup.stage_reload`, for the MTP weights."""
        try:
            return [ray.get(self.actor.stage_reload.remote(files))]
        except RayActorError as exc:
            raise WorkerDiedError(f"draft worker died during stage_reload: {root_cause(exc)}") from exc

    def commit_reload(self, files: ModelFiles) -> None:
        """Like :meth:`WorkerGroup.commit_reload`."""
        try:
            ray.get(self.actor.commit_reload.remote())
        except RayActorError as exc:
            raise WorkerDiedError(f"draft worker died during commit_reload: {root_cause(exc)}") from exc
        self.files = files

    def discard_reload(self) -> None:
        """Drop a staged reload (best effort)."""
        ray.wait([self.actor.discard_reload.remote()], timeout=30)

    def shutdown(self) -> None:
        """Stop the actor (after it removed its buffers' name, if it still answers). Idempotent."""
        self._close_channel()
        if self.actor is not None:
            ray.wait([self.actor.shutdown.remote()], timeout=5)
            ray.kill(self.actor, no_restart=True)
            self.actor = None
