"""One rank's model, paged KV cache and per-request state; executes step plans.

Common path only (vLLM V2 runner's rule): turn a :class:`StepPlan` into packed input tensors and
attention metadata, run the forward, compute logits for the rows that sample, and (rank 0) sample.
Everything a step touches lives on the runner's device (``cuda`` or ``cpu``, one code path): the
weights, the KV / indexer caches, the step's inputs (one host-to-device copy) and the sampler's
generators; only the sampled token ids (and logprobs, logits or hidden states when asked) come back.
Features live in helpers: the sampler, the model classes, ``workers/device.py`` (device, dtype and
memory rules), ``workers/step_inputs.py`` (input layout and upload), ``workers/memory_profile.py``
(KV sizing on CUDA), ``workers/cuda_graphs.py`` (captured decode steps) and
``workers/state_cache.py`` (the recurrent-state pool of hybrid models).
"""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from shardserve.kernels import cpu_attention
from shardserve.workers.checkpoint import GGUFCheckpoint
from shardserve.workers.compilation import CompiledForward, forward_key, start_loading, use_compile
from shardserve.workers.device import (DeviceConfigError, bound_cpu_kernel_caches, gib, host_memory_available,
                                       resolve_device, resolve_dtype)
from shardserve.workers.distributed import get_expert_group, get_tp_group
from shardserve.workers.forward_context import AttentionMetadata, forward_context
from shardserve.workers.fp8 import keeps_fp8
from shardserve.workers.logits_processors import SamplingControls, apply_token_bitmasks
from shardserve.workers.messages import PLACEHOLDER_TOKEN, DataParallelPlan, SamplingOptions, StepPlan, StepResult
from shardserve.workers.model_source import ModelFiles, model_context_length
from shardserve.workers.plan import (LIBRARY_WORKSPACE_BYTES, PlanConfig, RankPlan, cache_bytes, check_plan,
                                     decode_graph_backend, plan_rank)
from shardserve.workers.quantization import WeightFormat, weight_format_for
from shardserve.workers.rejection_sampler import sample_with_drafts
from shardserve.workers.sampler import sample_on_device, sampled_tokens
from shardserve.workers.state_cache import StateCache
from shardserve.workers.step_inputs import DeviceStager, HostBatch, build_host_batch, device_batch
from shardserve.workers.weight_loader import build_model
from shardserve.workers.weight_reload import open_recorded

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerConfig:
    """How a runner builds its model and cache (same on every rank; ``auto`` resolved on the rank)."""

    block_size: int = 16                 # tokens per KV block
    kv_cache_bytes: int = 1 << 30        # cache budget of a CPU rank, bytes
    num_blocks: int | None = None        # overrides the budget when set
    tensor_split: list[float] | None = None
    device: str = "auto"                 # "auto" (cuda when this rank sees a GPU), "cuda" or "cpu"
    dtype: str = "auto"                  # "auto" (bfloat16 on cuda; cpu: workers/device.py), "bfloat16", "float16", "float32"
    quantization: str = "none"           # "none", "int8", "int4": pack a float checkpoint's weights (CPU)
    gpu_memory_utilization: float = 0.9  # fraction of the GPU this rank may use (weights, activations, caches)
    enforce_eager: bool = False          # no decode graphs on CUDA
    decode_graphs: str = "auto"          # "auto": CUDA graphs on CUDA unless enforce_eager; "replay": the
                                         # eager stand-in on any device (tests, dry runs); "off"
    max_num_seqs: int = 64               # largest decode batch (graph sizes, profiling, recurrent-state pool)
    max_num_batched_tokens: int = 2048   # largest step (profiling)
    max_model_len: int | None = None     # longest sequence (graph table width, profiling); None = the model's
    seed: int = 0                        # seed of the generator for unseeded requests
    gpu_fraction: float = 1.0            # share of its GPU this rank may use (fractional --gpus-per-worker)
    draft_on_device: bool = False        # this rank also holds the MTP draft (counted in its plan)
    compile: str = "off"                 # "off", "auto" (where it pays: CPU ranks) or "on": torch.compile'd
                                         # forward (workers/compilation.py)
    packed_dense_rows: str = "0"         # "auto" or a row count: dense copies of packed CPU weights (WeightFormat)
    attention_dp_size: int = 1           # attention groups of the replica (issue 29; 1 = plain TP): rank r is in
                                         # group r // (tp_size / attention_dp_size); MoE experts span every rank
    moe_a2a: str = "allgather"           # MoE token exchange across groups: "allgather" or "alltoall"


def weight_format_of(ckpt, dtype: str, device: str, quantization: str,
                     packed_dense_rows: str = "0") -> tuple[torch.dtype, WeightFormat | None]:
    """Compute dtype and weight format of a rank (``--dtype auto`` on CPU looks at the GGUF
    file's types: :func:`workers.device.resolve_dtype`; packed weights are CPU-only, with dense
    copies as ``packed_dense_rows`` says: :func:`workers.quantization.weight_format_for`).

    Raises:
        DeviceConfigError: ``--quantization`` on a CUDA rank.
    """
    is_gguf = isinstance(ckpt, GGUFCheckpoint)
    if quantization != "none" and device != "cpu":
        raise DeviceConfigError(f"--quantization {quantization} runs on CPU ranks only (this rank: {device})")
    resolved = resolve_dtype(dtype, device, ckpt.matrix_types() if is_gguf else None, quantization)
    if device != "cpu":
        return resolved, None
    return resolved, weight_format_for(resolved, quantization, is_gguf, packed_dense_rows, ckpt)


def allocate_caches(layers, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> int:
    """Give every layer zero-filled cache tensors on ``device`` as its ``cache_spec`` asks; returns their bytes.

    On CPU they are views of one anonymous ``mmap``: the OS hands out zero pages that become
    resident only when a block is first written (``torch.zeros`` writes every byte, making the
    worst-case cache resident at start; numpy's ``zeros`` asks for 2 MiB huge pages, so each
    layer's first token made 4 MiB resident)."""
    specs = [layer.cache_spec(num_blocks, block_size) for layer in layers]
    if torch.device(device).type != "cpu":
        for layer, spec in zip(layers, specs):
            layer.kv_cache = tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in spec)
        return cache_bytes(layers, num_blocks, block_size)
    import mmap

    sizes = [math.prod(shape) * dtype.itemsize for spec in specs for shape, dtype in spec]
    buffer = torch.frombuffer(mmap.mmap(-1, max(1, sum(-(-size // 64) * 64 for size in sizes))), dtype=torch.uint8)
    offset = 0
    for layer, spec in zip(layers, specs):
        tensors = []
        for shape, dtype in spec:
            size = math.prod(shape) * dtype.itemsize
            tensors.append(buffer[offset:offset + size].view(dtype).view(shape))
            offset += -(-size // 64) * 64
        layer.kv_cache = tuple(tensors)
    return sum(sizes)


@dataclass(slots=True)
class RequestState:
    """What a worker keeps per request between steps."""

    block_ids: list[int]
    sampling: SamplingOptions
    last_sampled: int = PLACEHOLDER_TOKEN   # rank 0: the last token sampled for it (fills placeholders)


def apply_request_diffs(requests: dict[str, RequestState], finished_req_ids, new_requests, scheduled) -> None:
    """Apply one plan's diff to a worker's per-request state: forget finished requests first,
    then add new ones, then append each scheduled request's new block ids (shared by the target
    runner and the MTP draft worker, which mirror the same block tables)."""
    for req_id in finished_req_ids:
        requests.pop(req_id, None)
    for new in new_requests:
        requests[new.req_id] = RequestState([], new.sampling)
    for sched in scheduled:
        requests[sched.req_id].block_ids.extend(sched.new_block_ids)


class ModelRunner:
    """Owns this rank's model shard and KV cache, on one device.

    Args:
        files: resolved model files.
        hf_config: transformers config of the model.
        config: cache/parallel/device settings.

    Attributes:
        device / dtype: where and in what the rank computes.
        num_blocks: KV blocks allocated on this rank (the coordinator's pool; with decode graphs one
            more scratch block follows them).
        weight_bytes / cache_bytes: memory held by weights and by the caches (with the
            recurrent-state pool, if any) on this rank.
        plan: the rank's :class:`workers.plan.RankPlan` (weights, reserves, KV budget and blocks),
            made before any weight is read and, on CUDA, re-solved with the profiled measurements.
        num_state_slots: recurrent-state slots (hybrid models: ``max_num_seqs + 1``, one spare for
            ``EngineCore.prompt_logits`` probes; 0 otherwise).

    Raises:
        DeviceConfigError: ``--device cuda`` on a rank without a GPU; ``--indexer-cache-dtype fp8`` on a GPU
            older than compute capability 8.9 (Triton takes no e4m3 there).
        DoesNotFitError: the weights, the profiling forward or one cache block do not fit.
    """

    def __init__(self, files: ModelFiles, hf_config, config: RunnerConfig, progress: bool = True) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(resolve_device(config.device))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        else:
            bound_cpu_kernel_caches()
        self.dp_group = self._check_attention_dp(hf_config, config)
        if (self.device.type == "cuda" and getattr(hf_config, "shardserve_indexer_cache_dtype", "auto") == "fp8"
                and not keeps_fp8(self.device)):
            raise DeviceConfigError(f"--indexer-cache-dtype fp8 needs a GPU of compute capability 8.9 or newer "
                                    f"(this one: {torch.cuda.get_device_capability(self.device)}): use 'auto'")
        self.checkpoint = open_recorded(files.path)   # reads recorded: digests for weight reloads
        self.dtype, weight_format = weight_format_of(self.checkpoint, config.dtype, self.device.type,
                                                     config.quantization, config.packed_dense_rows)
        self.block_size = config.block_size
        model_len = model_context_length(hf_config)
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.plan: RankPlan | None = None
        self._plan_config: PlanConfig | None = None
        self._compile_key: str | None = None
        self._compile_loading: Future | None = None   # the compiled forward's read, started before the weights'
        self.model, self.weight_bytes = build_model(
            hf_config, self.checkpoint, config.tensor_split, self.dtype, progress, device=self.device,
            keep_fp8=keeps_fp8(self.device), before_load=self._before_load, weight_format=weight_format)
        self.forward = self.model   # the compiled forward after allocate_kv_cache with --compile
        self.compiled: CompiledForward | None = None
        self.weight_record = self.checkpoint.observer.record
        self.requests: dict[str, RequestState] = {}
        self.controls: SamplingControls | None = None   # rank 0: penalties, logit_bias, ... (made on first use)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.stager = DeviceStager(self.device)
        self.num_blocks, self.cache_bytes = 0, 0
        self.graphs = None
        self.last_hidden_states: torch.Tensor | None = None   # [T, hidden] of the last plan with return_hidden
        self.draft_buffers = None   # rank 0 with MTP: the draft worker's shared buffers (workers/draft_buffers.py)
        self.state_layers = getattr(self.model, "state_layers", list)()
        self.num_state_slots = config.max_num_seqs + 1 if self.state_layers else 0
        self.state_cache: StateCache | None = None
        if self.device.type == "cuda" and config.num_blocks is None:
            self.profile_memory()
        if config.num_blocks is not None:
            self.allocate_kv_cache(config.num_blocks)

    @staticmethod
    def _check_attention_dp(hf_config, config: RunnerConfig) -> int:
        """This rank's attention group (0 without data-parallel attention). With it, the process's
        TP group is the attention group and the expert group spans ``attention_dp_size`` of them
        (``workers/distributed.py``); the model reads the MoE exchange from ``shardserve_moe_a2a``.

        Raises:
            ValueError: the installed groups do not match ``attention_dp_size``, or an unknown mode.
        """
        if config.attention_dp_size == 1:
            return 0
        tp, ep = get_tp_group(), get_expert_group()
        if ep.tp_size != tp.tp_size * config.attention_dp_size:
            raise ValueError(f"attention_dp_size={config.attention_dp_size} needs an expert group of "
                             f"{tp.tp_size * config.attention_dp_size} ranks around the {tp.tp_size}-rank attention "
                             f"group; the installed one has {ep.tp_size}")
        if config.moe_a2a not in ("allgather", "alltoall"):
            raise ValueError(f"--moe-a2a {config.moe_a2a!r}: expected 'allgather' or 'alltoall'")
        hf_config.shardserve_moe_a2a = config.moe_a2a
        return ep.tp_rank // tp.tp_size

    # -- memory -------------------------------------------------------------------------------
    @property
    def graph_backend(self) -> str | None:
        """``"cuda"``, ``"replay"`` or None (eager decode), from ``config.decode_graphs``
        (:func:`workers.plan.decode_graph_backend`). Data-parallel attention decodes eagerly: the
        MoE exchange's token counts change every step (``workers/models/moe_exchange.py``)."""
        from shardserve.kernels.dispatch import use_triton

        if self.config.attention_dp_size > 1:
            return None
        return decode_graph_backend(self.config.decode_graphs, self.config.enforce_eager, self.device.type,
                                    use_triton(torch.empty(0, device=self.device)))

    def plan_config(self) -> PlanConfig:
        """This rank's :class:`workers.plan.PlanConfig`: the runner's settings, its device's size
        (CUDA: the GPU's total times ``gpu_fraction``, with the memory in use now, the CUDA context,
        NCCL and other processes, as memory outside torch; CPU: the host memory available)."""
        from shardserve.kernels.dispatch import use_triton

        cfg, overhead = self.config, None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            device_bytes = int(total * min(1.0, cfg.gpu_fraction))
            overhead = total - free + LIBRARY_WORKSPACE_BYTES
        else:
            device_bytes = host_memory_available()
        return PlanConfig(get_tp_group().tp_size, self.device.type, device_bytes, cfg.gpu_memory_utilization,
                          cfg.kv_cache_bytes, cfg.num_blocks, self.block_size, self.max_model_len, cfg.max_num_seqs,
                          cfg.max_num_batched_tokens, cfg.decode_graphs, cfg.enforce_eager,
                          use_triton(torch.empty(0, device=self.device)), overhead)

    def _before_load(self, meta_model, weight_bytes: int) -> None:
        """Plan the rank (:meth:`_plan_rank`) and, with ``--compile``, start reading its compiled
        forward from the disk cache while the weights load (``workers/compilation.py``)."""
        self._plan_rank(meta_model, weight_bytes)
        if self._compiles():
            config = {name: value for name, value in self.hf_config.to_dict().items()
                      if name not in ("_name_or_path", "_commit_hash")}   # where the files are, not what
            config_text = json.dumps(config, sort_keys=True, default=repr)
            self._compile_key = forward_key(meta_model, self.device, config_text)
            self._compile_loading = start_loading(meta_model, self._compile_key)

    def _plan_rank(self, meta_model, weight_bytes: int) -> None:
        """Before any weight is read: plan this rank from its meta-device model (``workers/plan.py``,
        the plan ``shardserve plan`` prints), log it, and stop unless its weights, reserves and one
        KV block fit."""
        draft = None
        if self.config.draft_on_device:
            from shardserve.workers.models.mtp import build_mtp_meta_model

            draft = build_mtp_meta_model(self.hf_config, self.checkpoint, self.dtype)
        self._plan_config = self.plan_config()
        self.plan = plan_rank(meta_model, self._plan_config, get_tp_group().tp_rank, draft)
        if self.config.attention_dp_size > 1:   # the layers run over every group's tokens (as `plan` plans it)
            from shardserve.workers.plan_dp import exchange_reserve

            self.plan.activation_bytes += exchange_reserve(meta_model, self.config.attention_dp_size,
                                                           get_expert_group().tp_size,
                                                           self.config.max_num_batched_tokens, self._plan_config.triton)
            self.plan.solve(self._plan_config)
        logger.info("plan: %s", self.plan.summary())
        check_plan(self.plan)

    def profile_memory(self) -> RankPlan:
        """Run the largest step once (:meth:`workers.activation.StepShape.prefill`). On CUDA, measure
        its peak and the memory held outside torch, and re-solve :attr:`plan` with them (the larger
        of the measured and the planned activation reserve; a warning names an under-estimate). On
        CPU the forward runs, nothing is measured.

        Raises:
            DoesNotFitError: the step cannot run in the free memory, or no KV block is left.
        """
        from shardserve.workers.activation import StepShape
        from shardserve.workers.memory_profile import measure_cuda, run_step

        cfg = self.config
        allocate = lambda layers, blocks: allocate_caches(layers, blocks, self.block_size, self.device)  # noqa: E731
        shape = StepShape.prefill(cfg.max_num_batched_tokens, self.max_model_len, cfg.max_num_seqs)
        if self.device.type != "cuda":
            run_step(self.model, self.device, shape, self.block_size, allocate)
            return self.plan
        planned = self.plan.activation_bytes
        activation, other = measure_cuda(self.model, self.device, shape, self.block_size, allocate, planned)
        if activation > planned:
            logger.warning("rank %d: the profiled step peaked at %s above the weights, more than the %s "
                           "workers/activation.py plans for it; the KV budget uses the measurement",
                           get_tp_group().tp_rank, gib(activation), gib(planned))
        self.plan.activation_bytes = max(planned, activation)
        self.plan.overhead_bytes = other + LIBRARY_WORKSPACE_BYTES
        self.plan.solve(self._plan_config)
        logger.info("measured: %s", self.plan.summary())
        check_plan(self.plan)
        return self.plan

    @property
    def bytes_per_block(self) -> int:
        """KV cache bytes one block takes on this rank, over all layers (and the MTP draft's caches,
        which share rank 0's device)."""
        draft = self.plan.draft_bytes_per_token * self.block_size if self.config.draft_on_device else 0
        return cache_bytes(self.model.attention_layers(), 1, self.block_size) + draft

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent-state pool on this rank (0 for models without recurrent layers;
        with decode graphs one scratch slot more)."""
        return cache_bytes(self.state_layers, self.num_state_slots + (self.graph_backend is not None), 1)

    def max_num_blocks(self) -> int:
        """Blocks that fit this rank's budget: ``num_blocks`` when set, else :attr:`plan`'s
        (the CUDA rule or the CPU ``kv_cache_bytes``, after the recurrent-state pool and the graphs'
        scratch block)."""
        if self.config.num_blocks:
            return self.config.num_blocks
        return self.plan.kv_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks in every layer's cache tensors on the device (every rank
        gets the same count: the smallest any rank can hold), zero-filled; then capture the decode
        graphs, which need the caches' addresses (plus one scratch block for their padded rows)."""
        backend = self.graph_backend
        self.num_blocks = num_blocks
        self.cache_bytes = allocate_caches(self.model.attention_layers(), num_blocks + (backend is not None),
                                           self.block_size, self.device)
        if self.state_layers:   # one state slot per sequence (+ the graphs' scratch slot), beside the KV cache
            self.cache_bytes += allocate_caches(self.state_layers, self.num_state_slots + (backend is not None), 1,
                                                self.device)
            self.state_cache = StateCache(self.state_layers, self.num_state_slots)
            logger.info("rank %d: recurrent-state pool %.1f MiB in %d slots", get_tp_group().tp_rank,
                        self.state_bytes / 2**20, self.num_state_slots)
        logger.info("rank %d on %s (%s): weights %.1f MiB, activations %.1f MiB, KV cache %.1f MiB in %d blocks of %d "
                    "tokens", get_tp_group().tp_rank, self.device, str(self.dtype).removeprefix("torch."),
                    self.weight_bytes / 2**20, self.plan.activation_bytes / 2**20, self.cache_bytes / 2**20,
                    num_blocks, self.block_size)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            cpu_attention.available()   # builds the C decode attention now (first start: ~1 s), not in a request
        self.compile_forward()
        self.capture_graphs()
        self.check_memory_held()

    def check_memory_held(self) -> None:
        """After KV allocation and graph capture: log what this rank holds against its plan; on
        CUDA the device's used memory (this process and any other) must stay within
        ``--gpu-memory-utilization`` of it.

        Raises:
            DoesNotFitError: more is in use than the plan's capacity (the message names the parts).
        """
        rank, plan = get_tp_group().tp_rank, self.plan
        graphs = sum(t.numel() * t.element_size() for _, t in self.graphs.named_tensors()) if self.graphs else 0
        if self.device.type != "cuda":
            logger.info("rank %d holds weights %s, caches %s, graph buffers %s (planned: weights %s, KV budget %s)",
                        rank, gib(self.weight_bytes), gib(self.cache_bytes), gib(graphs), gib(plan.weight_bytes),
                        gib(plan.kv_budget_bytes))
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        held, allocated = total - free, torch.cuda.memory_allocated(self.device)
        parts = (f"weights {gib(self.weight_bytes)}, caches {gib(self.cache_bytes)}, other torch tensors and graph "
                 f"pools {gib(allocated - self.weight_bytes - self.cache_bytes)}, torch's cache "
                 f"{gib(torch.cuda.memory_reserved(self.device) - allocated)}, outside torch "
                 f"{gib(held - torch.cuda.memory_reserved(self.device))}")
        logger.info("rank %d after KV allocation and graph capture: %s in use of the %s allowed (%s)", rank,
                    gib(held), gib(plan.capacity), parts)
        if held > plan.capacity:
            from shardserve.workers.device import DoesNotFitError

            raise DoesNotFitError(
                f"rank {rank} uses {gib(held)} of {self.device} after KV allocation and graph capture, more than "
                f"--gpu-memory-utilization {self.config.gpu_memory_utilization} x {gib(plan.device_bytes)} = "
                f"{gib(plan.capacity)} ({parts}): the plan under-counts this rank by {gib(held - plan.capacity)}; run with "
                "--enforce-eager (no graph pool) or a lower --max-num-seqs, and report it")

    def _compiles(self) -> bool:
        # data-parallel attention: the MoE exchange reads host counts per step, the forward stays eager
        return use_compile(self.config.compile, self.device) and self.config.attention_dp_size == 1

    def compile_forward(self) -> None:
        """With ``--compile`` on for this device: compile the forward now (a warm-up step on the
        scratch-free first block), or take the one read from the disk cache while the weights
        loaded (:meth:`_before_load`), so no request pays for it."""
        if self.compiled is not None or not self._compiles():
            if self.config.attention_dp_size > 1 and use_compile(self.config.compile, self.device):
                logger.info("data-parallel attention: the forward runs eagerly (no --compile)")
            return
        self.compiled = CompiledForward(self.model, self._compile_key, self._compile_loading)
        self.forward = self.compiled
        self.compiled.warm_up(self.block_size, self.device)

    def capture_graphs(self) -> None:
        """(Re)capture the decode graphs on the allocated caches, when this runner uses them (again
        after its TP group's communicator was re-formed: graphs hold their all-reduces)."""
        backend = self.graph_backend
        if backend is not None:
            from shardserve.workers.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.forward, self.device, self.config.max_num_seqs, self.max_model_len,
                                       self.block_size, self.num_blocks, backend,
                                       self.num_state_slots if self.state_layers else None)
            self.graphs.capture()

    def memory_info(self) -> dict:
        """Bytes per rank for the coordinator's log: weights, activations, other, cache, and the
        plan's summary line."""
        plan = self.plan
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "weights": self.weight_bytes, "activation": plan.activation_bytes, "other": plan.overhead_bytes,
                "cache": self.cache_bytes, "plan": plan.summary()}

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the runner keeps between steps: parameters, buffers, cache tensors, the
        decode graphs' fixed buffers and the last hidden states."""
        named = list(self.model.named_parameters()) + list(self.model.named_buffers())
        for idx, layer in enumerate(self.model.attention_layers()):
            named += [(f"cache.{idx}.{i}", t) for i, t in enumerate(layer.kv_cache or ())]
        for idx, layer in enumerate(self.state_layers):
            named += [(f"state.{idx}.{i}", t) for i, t in enumerate(layer.kv_cache or ())]
        if self.graphs is not None:
            named += [(f"graphs.{name}", t) for name, t in self.graphs.named_tensors()]
        if self.last_hidden_states is not None:
            named.append(("last_hidden_states", self.last_hidden_states))
        return named

    def tensors_off_device(self, *extra: tuple[str, torch.Tensor]) -> list[str]:
        """``"name: device"`` of every tensor of :meth:`named_tensors` (and ``extra``) that is not on
        the runner's device, plus the sampler's generator; empty when everything is in place."""
        wrong = [f"{name}: {t.device}" for name, t in [*self.named_tensors(), *extra] if t.device != self.device]
        if self.generator.device != self.device:
            wrong.append(f"generator: {self.generator.device}")
        return wrong

    def attach_draft_buffers(self, buffers) -> None:
        """Rank 0 with MTP speculation: write hidden states into, and read draft distributions from,
        the draft worker's :class:`workers.draft_buffers.DraftBuffers` (no host copy per step)."""
        self.draft_buffers = buffers

    # -- one step -----------------------------------------------------------------------------
    def _apply_plan(self, plan: StepPlan) -> None:
        apply_request_diffs(self.requests, plan.finished_req_ids, plan.new_requests, plan.scheduled)
        if get_tp_group().tp_rank == 0:
            self._track_controls(plan)

    def _track_controls(self, plan: StepPlan) -> None:
        """Rank 0: forget finished requests' control state, take it for new ones that have controls."""
        if self.controls is not None:
            for req_id in plan.finished_req_ids:
                self.controls.remove(req_id)
        for new in plan.new_requests:
            if new.sampling.has_controls:
                if self.controls is None:
                    self.controls = SamplingControls(self.hf_config.vocab_size, self.device)
                self.controls.add(new.req_id, new.sampling, new.token_ids or [], new.num_prompt_tokens)

    def _host_batch(self, plan: StepPlan) -> HostBatch:
        """The step's host layout; placeholders (async scheduling) hold rank 0's last samples on rank
        0 and 0 elsewhere, their rows kept in ``placeholder_rows`` when ranks must share them.

        Raises:
            RuntimeError: rank 0 never sampled for a placeholder's request (a coordinator bug).
        """
        host = build_host_batch(plan, {s.req_id: self.requests[s.req_id].block_ids for s in plan.scheduled},
                                self.block_size)
        if not host.placeholder_rows:
            return host
        group = get_tp_group()
        if group.tp_rank == 0:
            holes = [sched for sched in plan.scheduled if sched.token_ids[-1] == PLACEHOLDER_TOKEN]
            for row, sched in zip(host.placeholder_rows, holes):
                token = self.requests[sched.req_id].last_sampled
                if token == PLACEHOLDER_TOKEN:
                    raise RuntimeError(f"the plan has a placeholder for {sched.req_id!r}, which rank 0 never sampled")
                host.input_ids[row] = token
        if group.tp_size == 1:
            host.placeholder_rows = []
        return host

    @staticmethod
    def _share_placeholders(input_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Async scheduling at TP > 1: every rank's ``input_ids[rows]`` become rank 0's (the other
        ranks hold 0 there) in one all-reduce on the device: no host round trip on any rank (exact on
        every backend: ids are far below 2**24, the shm backend sums in float32)."""
        input_ids.index_copy_(0, rows, get_tp_group().all_reduce(input_ids.index_select(0, rows)))

    def _prepare_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids [T], metadata, logits_rows [R])`` on the runner's device (eager layout)."""
        return self._device_inputs(self._host_batch(plan), plan)

    def _device_inputs(self, host: HostBatch, plan: StepPlan,
                       dp_counts: list[int] | None = None) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        input_ids, meta, rows = device_batch(host, self.stager, self._share_placeholders)
        meta.dp_token_counts = dp_counts
        if self.state_cache is not None:   # hybrid models: the recurrent-state slots of this step
            meta.state = self.state_cache.begin_step(plan)
        return input_ids, meta, rows

    def own_plan(self, plan: StepPlan | DataParallelPlan) -> StepPlan:
        """The plan this rank computes: its attention group's part of a :class:`DataParallelPlan`."""
        return plan.plans[self.dp_group] if isinstance(plan, DataParallelPlan) else plan

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan | DataParallelPlan) -> torch.Tensor:
        """Apply ``plan`` (with data-parallel attention: this group's part) and run the forward;
        float32 logits ``[rows, vocab]`` on the device, one row per sampling request plus one per
        draft token it verifies. Pure decode steps replay a captured graph when there is one for
        their (padded) batch size. An idle attention group joins the other groups' MoE exchanges."""
        counts, logit_counts = ((plan.token_counts, plan.logit_counts) if isinstance(plan, DataParallelPlan)
                                else (None, None))
        plan = self.own_plan(plan)
        self._apply_plan(plan)
        self.last_hidden_states = None
        if not plan.scheduled:
            if counts is not None and any(counts):
                self.model.idle_forward(counts, logit_counts)
            return torch.empty(0, self.hf_config.vocab_size, device=self.device)
        host = self._host_batch(plan)
        if self.graphs is not None and host.is_decode and self.graphs.padded_size(host.num_seqs):
            state_slots = None if self.state_cache is None else self.state_cache.begin_decode(plan)
            hidden, rows = self.graphs.run(host, self.stager, state_slots, self._share_placeholders), None
            meta = None
        else:
            input_ids, meta, rows = self._device_inputs(host, plan, counts)
            meta.dp_logit_counts = logit_counts
            with forward_context(meta):
                hidden = self.forward(input_ids, meta.positions)
        if plan.return_hidden:
            self.last_hidden_states = hidden.clone() if rows is None else hidden
        if counts is None:
            return self.model.compute_logits(hidden if rows is None else hidden[rows])
        with forward_context(meta):   # the LM head's exchange reads every group's row counts
            return self.model.compute_logits(hidden[rows])

    def _process_logits(self, logits: torch.Tensor, sampling: list) -> torch.Tensor:
        """Rank 0: the logits sampling draws from (``workers/logits_processors.py``): grammar masks
        and sampling controls applied to a copy; ``logits`` itself when nothing applies (they stay
        the raw model logits, which logprobs report)."""
        masked = any(s.token_bitmask is not None for s in sampling)
        controlled = self.controls is not None and any(s.req_id in self.controls.requests for s in sampling)
        if not masked and not controlled:
            return logits
        processed = logits.clone()
        apply_token_bitmasks(processed, sampling)
        if controlled:
            self.controls.apply(processed, sampling)
        return processed

    def execute(self, plan: StepPlan | DataParallelPlan) -> StepResult | None:
        """Run one step. Rank 0 (of each attention group) returns the sampled tokens of its plan
        (host data); other ranks return None."""
        logits = self.compute_logits(plan)
        if get_tp_group().tp_rank != 0:
            return None
        plan = self.own_plan(plan)
        if not plan.scheduled:   # an idle attention group (data-parallel attention): nothing sampled
            return StepResult()
        hidden = self.last_hidden_states
        if hidden is not None and self.draft_buffers is not None:
            # the draft reads them there; queued before the sampler's read-back, so done when this returns
            assert hidden.shape[0] <= self.draft_buffers.hidden.shape[0], \
                f"{hidden.shape[0]} tokens in a step, the draft's hidden buffer holds {self.draft_buffers.hidden.shape[0]}"
            self.draft_buffers.hidden[:hidden.shape[0]].copy_(hidden)
            hidden = None
            if self.device.type == "cuda" and not any(s.sample for s in plan.scheduled):
                torch.cuda.current_stream(self.device).synchronize()   # no read-back follows to wait for it
        sampling = [s for s in plan.scheduled if s.sample]
        options = [self.requests[s.req_id].sampling for s in sampling]
        processed = self._process_logits(logits, sampling)
        if any(s.num_spec_tokens for s in sampling):
            buffers = self.draft_buffers
            sampled = sample_with_drafts(processed, sampling, options, None if buffers is None else buffers.probs,
                                         self.generator, logprob_logits=logits)
        else:
            tokens, logprobs = sample_on_device(processed, options, [s.output_index for s in sampling],
                                                self.generator, logprob_logits=logits)
            sampled = sampled_tokens([s.req_id for s in sampling], tokens, logprobs, options)
        for token in sampled:   # in order: a request's last entry is its newest token
            self.requests[token.req_id].last_sampled = token.token_id
        if self.controls is not None:
            self.controls.record(sampled)
        return StepResult(sampled, logits.cpu() if plan.return_logits else None,
                          None if hidden is None else hidden.float().cpu())
