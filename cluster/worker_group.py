"""Spawn the tensor-parallel ShardWorker actors of one replica and drive them every step.

Placement: one bundle per rank. Inside a placement group that already exists (a Serve replica's,
or the one ``serve-grpc`` makes for the coordinator), rank i takes bundle ``i + bundle_offset``;
we never create a nested group there. Otherwise a group is made here (PACK on one node by
default, SPREAD allowed). Dispatch: a Ray Compiled Graph (shared-memory channels, no task round
trip per step) or plain actor calls; both send the same StepPlan to every rank at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardserve.workers.distributed import collective_kind
from shardserve.workers.draft_worker import DraftWorker
from shardserve.workers.messages import DraftBatch, DraftResult, StepPlan, StepResult
from shardserve.workers.model_runner import RunnerConfig
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.partition import split_units
from shardserve.workers.worker import ShardWorker

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A shard worker died or failed; the replica cannot serve until restarted."""


@dataclass(slots=True)
class GroupConfig:
    """How to place and connect the ranks."""

    tensor_parallel_size: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    strategy: str = "PACK"              # PACK (one node) or SPREAD
    collective: str | None = None       # CPU: "shm" or "gloo"; None = pick by placement
    dispatch: str = "compiled"          # "compiled" (Ray Compiled Graph) or "calls"
    device: str = "auto"                # --device: "cpu" keeps CPU collectives even on GPU bundles


class WorkerGroup:
    """The ranks of one model replica.

    Args:
        files, hf_config: the model.
        runner_config: cache and split settings, same for every rank.
        config: placement and communication.
        max_batched_tokens, max_num_seqs: sizes of the largest collective payloads (shm slots).
        placement: an existing placement group and the bundle index of rank 0 in it.

    Raises:
        WorkerDiedError: a rank failed to start (the message carries its error).
    """

    def __init__(self, files: ModelFiles, hf_config, runner_config: RunnerConfig, config: GroupConfig,
                 max_batched_tokens: int, max_num_seqs: int,
                 placement: tuple[PlacementGroup, int] | None = None) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        self._own_pg = None
        if placement is None:
            bundle = {"CPU": config.cpus_per_worker, **({"GPU": config.gpus_per_worker} if config.gpus_per_worker else {})}
            self._own_pg = placement_group([dict(bundle) for _ in range(tp)], strategy=config.strategy)
            ray.get(self._own_pg.ready(), timeout=120)
            placement = (self._own_pg, 0)
        pg, offset = placement
        remote_cls = ray.remote(ShardWorker)
        threads = max(1, int(config.cpus_per_worker))
        self.workers = [
            remote_cls.options(
                num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=offset + rank),
            ).remote(rank, tp, threads)
            for rank in range(tp)
        ]
        self._segment = None
        self._dag = None
        try:
            self.collective = self._init_collective(hf_config, runner_config, max_batched_tokens, max_num_seqs)
            infos = _first_failure_get([w.load.remote(files, hf_config, runner_config) for w in self.workers])
        except Exception as exc:
            self.shutdown()
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ValueError):   # a bad device request or a model that does not fit: say it as is
                raise cause from None
            raise WorkerDiedError(f"shard workers failed to start: {exc}") from exc
        self.num_blocks = min(info["max_num_blocks"] for info in infos)
        self.num_state_slots = infos[0]["num_state_slots"]   # same on every rank (max_num_seqs + 1 or 0)
        try:
            cache_bytes = _first_failure_get([w.allocate_kv_cache.remote(self.num_blocks) for w in self.workers])
        except Exception as exc:
            self.shutdown()
            raise WorkerDiedError(f"shard workers failed to allocate their caches: {exc}") from exc
        for rank, (info, nbytes) in enumerate(zip(infos, cache_bytes)):
            info["cache_bytes"] = nbytes
            mem = info["memory"]
            logger.info("TP rank %d (pid %d, %s, %s): weights %.1f MiB, activations %.1f MiB, KV cache %.1f MiB in "
                        "%d blocks", rank, info["pid"], mem["device"], mem["dtype"], mem["weights"] / 2**20,
                        mem["activation"] / 2**20, nbytes / 2**20, self.num_blocks)
        self.rank_info = infos
        if config.dispatch == "compiled":
            self._compile()

    def _init_collective(self, hf_config, runner_config: RunnerConfig, max_tokens: int, max_seqs: int) -> str:
        tp = self.config.tensor_parallel_size
        if tp == 1:
            ray.get(self.workers[0].init_group.remote("none", {}))
            return "none"
        nodes = ray.get([w.node_address.remote() for w in self.workers])
        same_node = len({node for node, _ in nodes}) == 1
        device = "cuda" if self.config.gpus_per_worker and self.config.device != "cpu" else "cpu"
        kind = collective_kind(device, same_node, self.config.collective)
        if kind == "shm":
            from shardserve.workers.comm_cpu import SharedMemorySegment

            vocab_slice = max(size for _, size in split_units(hf_config.vocab_size, tp, runner_config.tensor_split))
            max_floats = max(max_tokens * hf_config.hidden_size, max_seqs * vocab_slice)
            self._segment = SharedMemorySegment(tp, max_floats)
            info = {"name": self._segment.name, "max_floats": max_floats}
        elif kind == "gloo":
            port = ray.get(self.workers[0].free_port.remote())
            info = {"init_method": f"tcp://{nodes[0][1]}:{port}"}
        else:
            info = {"unique_id": ray.get(self.workers[0].nccl_unique_id.remote())}
        ray.get([w.init_group.remote(kind, info) for w in self.workers])  # concurrent: ranks rendezvous
        if self._segment is not None:
            self._segment.unlink()   # every rank has it mapped: no name left behind, however Ray stops them
        return kind

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
        self._dag = dag.experimental_compile()

    def execute(self, plan: StepPlan) -> StepResult:
        """Send ``plan`` to every rank at once; rank 0's result.

        Raises:
            WorkerDiedError: any rank died or raised.
        """
        try:
            if self._dag is not None:
                return ray.get(self._dag.execute(plan))[0]
            return _first_failure_get([w.execute.remote(plan) for w in self.workers])[0]
        except Exception as exc:
            if self._segment is not None:
                self._segment.abort()  # unblock ranks spinning on a dead peer
            raise WorkerDiedError(f"shard worker failed: {type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        """Tear down the graph, stop the ranks and free the placement group. Idempotent."""
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001 - a dead actor makes teardown complain; we kill anyway
                pass
            self._dag = None
        if self._segment is not None:
            self._segment.abort()
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)
            self._own_pg = None


def _first_failure_get(refs: list) -> list:
    """``ray.get(refs)``, but raising the first failure as soon as it happens: the other ranks may
    be blocked in a collective waiting for the failed one (then the caller kills them)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)


class RemoteDrafter:
    """The replica's DraftWorker actor (MTP draft model), beside the shard workers.

    Args:
        files, hf_config: the model (its MTP layer is loaded).
        block_size, num_blocks: the target's cache layout (the draft caches share its block ids).
        config: CPUs/GPUs of the actor (one shard worker's share).
        placement: an existing placement group and the draft's bundle index in it (None: no group).
        seed: seed of the draft's generator for unseeded requests.
        device, dtype: as the shard workers' (``--device``, ``--dtype``).

    Raises:
        WorkerDiedError: the actor failed to start or load (e.g. the checkpoint has no MTP layer).
    """

    def __init__(self, files: ModelFiles, hf_config, block_size: int, num_blocks: int, config: GroupConfig,
                 placement: tuple[PlacementGroup, int] | None = None, seed: int = 0, device: str = "auto",
                 dtype: str = "auto") -> None:
        options = {"num_cpus": config.cpus_per_worker, "num_gpus": config.gpus_per_worker}
        if placement is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement[0], placement_group_bundle_index=placement[1])
        self.actor = ray.remote(DraftWorker).options(**options).remote(max(1, int(config.cpus_per_worker)))
        try:
            self.info = ray.get(self.actor.load.remote(files, hf_config, block_size, num_blocks, dtype, seed, device))
        except Exception as exc:
            self.shutdown()
            raise WorkerDiedError(f"draft worker failed to start: {exc}") from exc

    def propose(self, batch: DraftBatch) -> DraftResult:
        """Run one drafting pass on the actor.

        Raises:
            WorkerDiedError: the actor died or raised.
        """
        try:
            return ray.get(self.actor.propose.remote(batch))
        except Exception as exc:
            raise WorkerDiedError(f"draft worker failed: {type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        """Stop the actor. Idempotent."""
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
