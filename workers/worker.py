"""ShardWorker: one tensor-parallel rank as a Ray actor (the class is plain; the cluster wraps it
with ``ray.remote``). It joins the TP group, loads only its slice of the weights, allocates its
own paged caches, and executes step plans; rank 0 returns the samples.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from shardserve.workers.distributed import TensorParallelGroup, attention_group_layout, set_tp_group
from shardserve.workers.messages import DataParallelPlan, StepPlan, StepResult
from shardserve.workers.model_runner import ModelRunner, RunnerConfig
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.step_channel import StepHost
from shardserve.workers.torch_thread import on_torch_thread
from shardserve.workers.weight_reload import ReloadableRank

logger = logging.getLogger(__name__)


class ShardWorker(StepHost, ReloadableRank):
    """One TP rank (recovery and weight-reload calls come from :class:`ReloadableRank`).

    Args:
        tp_rank, tp_size: this rank.
        num_threads: torch intra-op threads (the CPUs reserved for this rank).
    """

    def __init__(self, tp_rank: int, tp_size: int, num_threads: int = 1) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        torch.set_num_threads(max(1, num_threads))
        self.group: TensorParallelGroup | None = None
        self.expert_group: TensorParallelGroup | None = None   # data-parallel attention: all ranks
        self.runner: ModelRunner | None = None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # -- rendezvous helpers (called on rank 0 before the group exists) ------------------------
    def node_address(self) -> tuple[str, str]:
        """``(node id, ip)`` of this actor's node."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def nccl_unique_id(self) -> tuple:
        from shardserve.workers.comm_nccl import nccl_unique_id

        return nccl_unique_id()

    # -- start-up -----------------------------------------------------------------------------
    @on_torch_thread
    def init_group(self, kind: str, info: dict) -> None:
        """Join the TP group. ``info``: ``init_method`` (gloo), ``name``/``max_floats`` (shm),
        ``unique_id`` (nccl). With data-parallel attention (``info["attention_dp_size"] > 1``) that
        group spans every rank and carries the routed experts, and ``info["groups"][g]`` (the same
        keys; absent for single-rank groups) forms attention group g, this rank's TP group."""
        num_groups = info.get("attention_dp_size", 1)
        if num_groups == 1:
            self.group = self._join(kind, self.tp_rank, self.tp_size, info)
            set_tp_group(self.group)
            return
        index, local_rank, size = attention_group_layout(self.tp_rank, self.tp_size, num_groups)
        self.expert_group = self._join(kind, self.tp_rank, self.tp_size, info)
        self.group = self._join(kind, local_rank, size, info["groups"][index] if size > 1 else {})
        set_tp_group(self.group, self.expert_group)

    @staticmethod
    def _join(kind: str, rank: int, size: int, info: dict) -> TensorParallelGroup:
        if size == 1:
            return TensorParallelGroup()
        if kind == "gloo":
            from shardserve.workers.comm_cpu import GlooGroup

            return GlooGroup(rank, size, info["init_method"])
        if kind == "shm":
            from shardserve.workers.comm_cpu import SharedMemoryGroup

            return SharedMemoryGroup(rank, size, info["name"], info["max_floats"])
        if kind == "nccl":
            from shardserve.workers.comm_nccl import CupyNcclGroup

            torch.cuda.set_device(0)   # Ray's CUDA_VISIBLE_DEVICES: this actor's GPU is device 0
            return CupyNcclGroup(rank, size, info["unique_id"])
        raise ValueError(f"unknown collective backend {kind!r}")

    @on_torch_thread
    def load(self, files: ModelFiles, hf_config, config: RunnerConfig) -> dict:
        """Build this rank's model shard (only its slice of each weight).

        Returns:
            ``{"max_num_blocks", "bytes_per_block", "weight_bytes", "num_state_slots", "pid", "memory",
            "fingerprint", "shapes"}`` for the coordinator, which then calls :meth:`allocate_kv_cache`
            with the smallest block count of any rank (``num_state_slots``: recurrent-state slots of
            hybrid models, else 0; ``memory``: :meth:`ModelRunner.memory_info`; fingerprint and
            shapes: :class:`workers.weight_reload.WeightRecord`).

        Raises:
            DeviceConfigError / DoesNotFitError: (``ValueError``) no GPU for ``--device cuda``, or
                the model does not fit this rank's device.
        """
        self.runner = ModelRunner(files, hf_config, config, progress=False)
        self.weight_loads += 1
        record = self.runner.weight_record
        return {"max_num_blocks": self.runner.max_num_blocks(), "bytes_per_block": self.runner.bytes_per_block,
                "weight_bytes": self.runner.weight_bytes, "num_state_slots": self.runner.num_state_slots,
                "pid": os.getpid(), "memory": self.runner.memory_info(),
                "fingerprint": record.fingerprint(), "shapes": dict(record.shapes)}

    @on_torch_thread
    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Allocate the paged caches (and capture the decode graphs); returns the caches' bytes on this rank."""
        self.runner.allocate_kv_cache(num_blocks)
        return self.runner.cache_bytes

    @on_torch_thread
    def attach_draft_buffers(self, handle: dict) -> None:
        """Rank 0 with MTP: map the draft worker's shared buffers (``workers/draft_buffers.py``)."""
        from shardserve.workers.draft_buffers import DraftBuffers

        self.runner.attach_draft_buffers(DraftBuffers.attach(handle))

    # -- every step ---------------------------------------------------------------------------
    @on_torch_thread
    def execute(self, plan: StepPlan | DataParallelPlan) -> StepResult | None:
        """Run one step; rank 0 (of each attention group, with data-parallel attention) returns the
        samples (and logits when the plan asks) with its time inside this call and inside collectives."""
        start, collective_before = time.perf_counter(), self._collective_s()
        result = self.runner.execute(plan)
        if result is not None:
            result.execute_s = time.perf_counter() - start
            result.collective_s = self._collective_s() - collective_before
        return result

    def _collective_s(self) -> float:
        return self.group.collective_s + (self.expert_group.collective_s if self.expert_group is not None else 0.0)

    def _weights(self) -> ModelRunner:
        return self.runner

    @on_torch_thread
    def rejoin(self) -> None:
        """A surviving rank after a peer was replaced and the group joined a new communicator:
        forget every request, zero the caches, and capture the decode graphs again (they hold the
        old communicator's all-reduces; on CUDA the replacement captures at the same time)."""
        self.reset_state()
        self.runner.capture_graphs()

    def leave_group(self) -> None:
        """Close this rank's collective communicator (a peer was replaced; :meth:`init_group` joins
        the new one). Not on the torch thread: that one may still be inside a collective with the
        dead peer (a shared-memory group waits for that collective to end before it unmaps)."""
        for group in (self.group, self.expert_group):
            if group is not None:
                group.close()
        self.group = self.expert_group = None

    def shutdown(self) -> None:
        self.close_step_channel()
        self.leave_group()
