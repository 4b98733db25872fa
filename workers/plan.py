"""The memory plan of a rank: what it will hold and how many KV blocks fit, before anything is allocated.

One truth for ``shardserve plan`` (every rank of a layout, from a checkpoint or its ``config.json``
alone) and for every rank of ``serve`` at start-up (its own rank, with its device's real size):
both build the rank's model on the meta device with the code that loads it
(:func:`workers.weight_loader.build_meta_model`: FP8 kept with its scales, packed int4/int8, float
weights) and solve the same arithmetic here.

The rule on a GPU (vLLM's ``--gpu-memory-utilization``, with every reserve budgeted before the KV
pool is sized)::

    capacity  = utilization x device bytes (the rank's share of its GPU)
    KV budget = capacity - weights - buffers - draft weights - activation reserve - graph reserve
                - memory outside torch (CUDA context, NCCL, library workspaces) - recurrent-state pool
    KV blocks = KV budget // bytes per block - 1 scratch block (decode graphs' padded rows)

The activation reserve is :func:`workers.activation.step_activation_bytes` of the largest step (the
profiling forward's shape); the graph reserve is the same function at the largest captured decode
batch (the CUDA graphs' shared pool) plus the graphs' fixed buffers. Memory outside torch is
estimated by ``plan`` (:data:`CUDA_RUNTIME_BYTES`, :data:`NCCL_BYTES`, :data:`LIBRARY_WORKSPACE_BYTES`)
and measured by ``serve``, which also replaces the activation reserve by the profiled peak when that
is larger, and checks after KV allocation and graph capture that the rank holds no more than
``capacity`` (``workers/model_runner.py``). On a CPU the KV budget is ``--kv-cache-gib`` and the
capacity the host memory available. Every rank of a replica allocates the smallest block count of
any rank.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shardserve.workers.activation import StepShape, dtype_bytes, step_activation_bytes
from shardserve.workers.checkpoint import Checkpoint, CheckpointError, LazyTensor
from shardserve.workers.device import DoesNotFitError, gib
from shardserve.workers.fp8 import keeps_fp8

GIB = 2**30
CUDA_RUNTIME_BYTES = GIB            # CUDA context, cuBLAS / Triton modules: plan's estimate (serve measures)
NCCL_BYTES = GIB                    # NCCL communicator buffers at TP > 1: plan's estimate (serve measures)
LIBRARY_WORKSPACE_BYTES = 128 << 20  # cuBLAS / cuBLASLt workspaces of the compute and capture streams


@dataclass(slots=True)
class PlanConfig:
    """What a rank's plan depends on besides its model (the same on every rank of a replica)."""

    tensor_parallel_size: int = 1
    device: str = "cuda"                  # "cuda" or "cpu"
    device_bytes: int = 0                 # bytes of the rank's device: GPU total x its GPU share; CPU: host available
    gpu_memory_utilization: float = 0.9   # fraction of device_bytes a CUDA rank may use
    kv_cache_bytes: int = GIB             # the KV budget of a CPU rank
    num_blocks: int | None = None         # exact KV blocks (overrides the budgets)
    block_size: int = 16                  # tokens per KV block
    max_model_len: int = 4096             # the context length served (tokens)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    decode_graphs: str = "auto"           # RunnerConfig.decode_graphs: "auto", "replay" or "off"
    enforce_eager: bool = False           # no CUDA graphs
    triton: bool = True                   # the CUDA kernels run (activation model; graphs need them)
    overhead_bytes: int | None = None     # memory outside torch's allocator; None: plan's estimate
    draft_on_rank: bool = False           # this rank also holds the MTP draft model and its caches

    def estimated_overhead(self) -> int:
        """Memory outside torch's allocator ``plan`` assumes on a GPU (``serve`` measures it)."""
        if self.device != "cuda":
            return 0
        if self.overhead_bytes is not None:
            return self.overhead_bytes
        return CUDA_RUNTIME_BYTES + (NCCL_BYTES if self.tensor_parallel_size > 1 else 0) + LIBRARY_WORKSPACE_BYTES


@dataclass(slots=True)
class RankPlan:
    """One rank's memory, planned (bytes unless named otherwise). The derived fields are set by
    :meth:`solve`; :meth:`summary` is the line ``serve`` logs and ``plan`` prints."""

    rank: int
    device: str                       # "cuda" / "cpu"
    device_bytes: int                 # the rank's device (share)
    capacity: int                     # what it may use: utilization x device_bytes (CPU: device_bytes)
    weight_bytes_by_dtype: dict[str, int]   # weights by storage format: "bfloat16", "float8_e4m3fn", "int4", ...
    buffer_bytes: int                 # RoPE tables
    draft_weight_bytes: int           # the MTP draft model on this rank (0: none here)
    kv_bytes_per_token: int           # latent (MLA) or K and V (GQA) caches of every layer
    indexer_bytes_per_token: int      # DSA indexer-key caches
    draft_bytes_per_token: int        # the MTP draft's latent + indexer caches (on this rank)
    state_bytes: int                  # recurrent-state pool (hybrid models)
    activation_bytes: int             # reserve for the largest step (workers/activation.py)
    graph_bytes: int                  # CUDA graph pool + graph buffers
    overhead_bytes: int               # outside torch's allocator (estimated by plan, measured by serve)
    block_size: int
    max_model_len: int
    scratch_blocks: int               # decode graphs' padded rows write one block no request owns
    kv_budget_bytes: int = 0          # what the KV / indexer / draft caches may take
    kv_blocks: int = 0
    starts: bool = False              # weights, reserves and one KV block fit: the rank can start
    fits: bool = False                # ... and one sequence of max_model_len tokens fits the pool
    reason: str = ""                  # why not (one line naming the numbers), else ""

    @property
    def weight_bytes(self) -> int:
        """This rank's model weights (all formats)."""
        return sum(self.weight_bytes_by_dtype.values())

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.indexer_bytes_per_token + self.draft_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens takes."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences of ``max_model_len`` tokens the pool holds at once."""
        return self.kv_blocks // self.blocks_per_seq

    @property
    def fixed_bytes(self) -> int:
        """Everything but the caches: weights, buffers, draft weights, reserves, overhead."""
        return (self.weight_bytes + self.buffer_bytes + self.draft_weight_bytes + self.activation_bytes
                + self.graph_bytes + self.overhead_bytes)

    def solve(self, config: PlanConfig) -> RankPlan:
        """Set the KV budget, blocks and whether the rank fits (see the module docstring)."""
        per_block = self.bytes_per_token * self.block_size
        if config.num_blocks is not None:
            self.kv_budget_bytes = config.num_blocks * per_block
            self.kv_blocks = config.num_blocks
        else:
            if self.device == "cuda":
                self.kv_budget_bytes = self.capacity - self.fixed_bytes - self.state_bytes
            else:
                self.kv_budget_bytes = config.kv_cache_bytes - self.state_bytes
            self.kv_blocks = max(0, self.kv_budget_bytes // per_block - self.scratch_blocks) if per_block else 0
        self.starts, self.fits, self.reason = False, False, ""
        if self.device == "cuda":
            where = (f"--gpu-memory-utilization {config.gpu_memory_utilization} x {gib(self.device_bytes)} = "
                     f"{gib(self.capacity)}")
            held = self.weight_bytes + self.buffer_bytes + self.draft_weight_bytes
            if held > self.capacity:
                self.reason = (f"the model does not fit on rank {self.rank}: its weights need {gib(held)}, more than "
                               f"{where}; use more tensor-parallel ranks, FP8 weights or a larger GPU")
                return self
            if self.kv_budget_bytes < per_block * (1 + self.scratch_blocks) and config.num_blocks is None:
                self.reason = (f"the model does not fit on rank {self.rank}: {where}, minus weights "
                               f"{gib(self.weight_bytes)}, buffers {gib(self.buffer_bytes)}, draft "
                               f"{gib(self.draft_weight_bytes)}, activations {gib(self.activation_bytes)}, CUDA graphs "
                               f"{gib(self.graph_bytes)}, outside torch {gib(self.overhead_bytes)} and the state pool "
                               f"{gib(self.state_bytes)} leaves {gib(self.kv_budget_bytes)}, less than one KV block "
                               f"({per_block} bytes); use more tensor-parallel ranks or a larger GPU, or lower "
                               "--max-num-batched-tokens / --max-model-len")
                return self
        elif self.capacity and (self.weight_bytes + self.buffer_bytes + self.draft_weight_bytes + self.kv_budget_bytes
                                + self.state_bytes > self.capacity):
            self.reason = (f"the model does not fit in host memory: weights "
                           f"{gib(self.weight_bytes + self.draft_weight_bytes)} + KV cache "
                           f"{gib(self.kv_budget_bytes + self.state_bytes)} exceed the {gib(self.capacity)} available; "
                           "lower --kv-cache-gib or use more tensor-parallel ranks")
            return self
        if self.kv_blocks < 1:
            self.reason = (f"the model does not fit on rank {self.rank}: a KV budget of {gib(self.kv_budget_bytes)} "
                           f"(after the recurrent-state pool, {gib(self.state_bytes)}) holds no block of {per_block} "
                           "bytes; raise --kv-cache-gib / --gpu-memory-utilization or lower --max-num-seqs")
            return self
        self.starts = True
        if self.kv_blocks < self.blocks_per_seq:
            self.reason = (f"rank {self.rank}: the KV pool holds {self.kv_tokens} tokens ({self.kv_blocks} blocks of "
                           f"{self.block_size}), less than one sequence of --max-model-len {self.max_model_len}")
            return self
        self.fits = True
        return self

    def summary(self) -> str:
        """One line: what the rank holds and what fits (logged by ``serve``, printed by ``plan``)."""
        dtypes = ", ".join(f"{name} {size_text(size)}" for name, size in sorted(self.weight_bytes_by_dtype.items()))
        return (f"rank {self.rank} ({self.device}, {size_text(self.capacity)} usable of {size_text(self.device_bytes)}): "
                f"weights {size_text(self.weight_bytes)} ({dtypes}), buffers {size_text(self.buffer_bytes)}, draft "
                f"{size_text(self.draft_weight_bytes)}; KV {self.kv_bytes_per_token} + indexer "
                f"{self.indexer_bytes_per_token} + draft {self.draft_bytes_per_token} bytes/token; activations "
                f"{size_text(self.activation_bytes)}, graphs {size_text(self.graph_bytes)}, outside torch "
                f"{size_text(self.overhead_bytes)}, state pool {size_text(self.state_bytes)}; KV budget "
                f"{size_text(self.kv_budget_bytes)} = {self.kv_blocks} blocks = {self.kv_tokens} tokens = "
                f"{self.max_concurrent_seqs} sequences of {self.max_model_len}")

    def to_dict(self) -> dict:
        """JSON-ready fields (``plan --json``'s ``ranks`` entries): ``rank``, ``device_bytes``,
        ``weight_bytes``, ``kv_bytes_per_token`` (KV + indexer + draft), ``kv_tokens``, ``fits`` and
        the details."""
        out = asdict(self)
        out.update(weight_bytes=self.weight_bytes, kv_bytes_per_token=self.bytes_per_token,
                   latent_kv_bytes_per_token=self.kv_bytes_per_token, kv_tokens=self.kv_tokens,
                   max_concurrent_seqs=self.max_concurrent_seqs, summary=self.summary())
        return out


def size_text(num_bytes: int) -> str:
    """``num_bytes`` in GiB from 1 GiB up, else in MiB (two decimals): tiny models stay readable."""
    return gib(num_bytes) if abs(num_bytes) >= GIB else f"{num_bytes / 2**20:.2f} MiB"


def cache_bytes(layers, num_blocks: int, block_size: int) -> int:
    """Bytes the caches of ``layers`` (modules with ``cache_spec``) take for ``num_blocks`` blocks."""
    return sum(math.prod(shape) * dtype.itemsize for layer in layers
               for shape, dtype in layer.cache_spec(num_blocks, block_size))


def _indexer_bytes(layers, block_size: int) -> int:
    return sum(math.prod(shape) * dtype.itemsize for layer in layers
               if getattr(layer, "indexer", None) is not None
               for shape, dtype in [layer.indexer.cache_spec(1, block_size)])


def _graph_bytes(model, config: PlanConfig, backend: str | None, hidden: int, dtype_bytes: int,
                 hybrid: bool = False) -> int:
    """Decode graphs: their fixed input buffers and outputs (``workers/cuda_graphs.py``), and on
    CUDA the shared pool, which holds the largest captured decode step's temporaries."""
    if backend is None:
        return 0
    from shardserve.workers.cuda_graphs import capture_sizes

    sizes = capture_sizes(config.max_num_seqs)
    largest, width = sizes[-1], -(-config.max_model_len // config.block_size)
    # ids, positions, slots, lengths (+ state slots), shared-placeholder rows, tables, query starts
    regions = 4 + hybrid
    buffers = ((regions + 1) * largest + 2 * largest * width + largest + 1) * 8
    if hybrid:
        buffers += (largest + 1) * 4                                     # int32 state starts
    if backend != "cuda":
        return buffers
    outputs = sum(sizes) * hidden * dtype_bytes                          # each graph's output, kept in the pool
    decode = StepShape.decode(largest, config.max_model_len)
    return buffers + outputs + step_activation_bytes(model, decode, config.triton, config.block_size)


def plan_rank(model, config: PlanConfig, rank: int, draft=None) -> RankPlan:
    """Plan one rank from its model (meta-device or loaded) and the replica's settings.

    Args:
        model: the rank's model (``workers.weight_loader.build_meta_model``).
        config: the replica's settings and this rank's device size.
        rank: the TP rank.
        draft: the MTP draft model on this rank (``workers.models.mtp.build_mtp_meta_model``), or None.

    Returns:
        the solved :class:`RankPlan`.
    """
    from shardserve.workers.weight_loader import buffer_bytes, weight_bytes_by_format

    bs = config.block_size
    layers = model.attention_layers()
    state_layers = getattr(model, "state_layers", list)()
    indexer = _indexer_bytes(layers, bs)
    kv = cache_bytes(layers, 1, bs) - indexer
    draft_weights = draft_tokens = 0
    if draft is not None:
        draft_weights = sum(weight_bytes_by_format(draft).values()) + buffer_bytes(draft)
        draft_tokens = cache_bytes(draft.attention_layers(), 1, bs)
    backend = decode_graph_backend(config.decode_graphs, config.enforce_eager, config.device, config.triton)
    shape = StepShape.prefill(config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs)
    activation = step_activation_bytes(model, shape, config.triton, bs)
    if draft is not None:
        activation = max(activation, step_activation_bytes(draft, shape, config.triton, bs))
    if backend == "replay":   # its decode steps run the MoE reference's sync-free form
        decode = StepShape.decode(config.max_num_seqs, config.max_model_len)
        activation = max(activation, step_activation_bytes(model, decode, config.triton, bs, graph_safe=True))
    capacity = (int(config.gpu_memory_utilization * config.device_bytes) if config.device == "cuda"
                else config.device_bytes)
    plan = RankPlan(
        rank=rank, device=config.device, device_bytes=config.device_bytes, capacity=capacity,
        weight_bytes_by_dtype=weight_bytes_by_format(model), buffer_bytes=buffer_bytes(model),
        draft_weight_bytes=draft_weights, kv_bytes_per_token=kv // bs, indexer_bytes_per_token=indexer // bs,
        draft_bytes_per_token=draft_tokens // bs,
        # one slot per sequence + 1 spare, + the decode graphs' scratch slot (padded rows)
        state_bytes=cache_bytes(state_layers, config.max_num_seqs + 1 + (backend is not None), 1) if state_layers else 0,
        activation_bytes=activation,
        graph_bytes=_graph_bytes(model, config, backend, model.config.hidden_size, dtype_bytes(model),
                                 bool(state_layers)),
        overhead_bytes=config.estimated_overhead(), block_size=bs, max_model_len=config.max_model_len,
        scratch_blocks=1 if backend is not None else 0)
    return plan.solve(config)


# -- a whole replica, from a checkpoint or its config.json -------------------------------------

class ConfigOnlyCheckpoint(Checkpoint):
    """A checkpoint known from its ``config.json`` alone (``shardserve plan`` of a folder without
    weights): every tensor the model reads is taken to exist, FP8 ``weight_scale_inv`` tensors where
    the released FP8 checkpoints have them (:func:`workers.fp8.released_fp8_weight`), ``lm_head``
    unless the embeddings are tied. Reading data raises.

    Args:
        path: the folder.
        config: its HF config.
    """

    def __init__(self, path: str | Path, config) -> None:
        from shardserve.workers.fp8 import quantization_config

        self.path = Path(path)
        self.config = config
        self._quant = quantization_config(config)
        self._tied = bool(getattr(config, "tie_word_embeddings", False))

    def names(self) -> list[str]:
        return []

    def __contains__(self, name: str) -> bool:
        from shardserve.workers.fp8 import SCALE_SUFFIX, released_fp8_weight

        if name.endswith(SCALE_SUFFIX):
            return released_fp8_weight(name[: -len(SCALE_SUFFIX)] + "weight", self._quant)
        return name != "lm_head.weight" or not self._tied

    def get(self, name: str) -> LazyTensor:
        def no_data(index: tuple) -> torch.Tensor:
            raise CheckpointError(f"{self.path}: no weights here (config.json only), cannot read {name!r}")

        return LazyTensor(name, str(self.path / "config.json"), (), no_data)


def open_for_plan(path: str | Path, config) -> Checkpoint:
    """The checkpoint at ``path`` (its metadata: nothing is read), or :class:`ConfigOnlyCheckpoint`
    for a folder with a ``config.json`` and no weight files."""
    from shardserve.workers.checkpoint import open_checkpoint

    path = Path(path)
    if path.is_dir() and not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").exists():
        return ConfigOnlyCheckpoint(path, config)
    return open_checkpoint(path)


@contextmanager
def as_rank(rank: int, tp_size: int):
    """Build models as rank ``rank`` of ``tp_size`` (a planning TP group, no communicator), then
    put the process's TP group back."""
    from shardserve.workers.distributed import TensorParallelGroup, get_tp_group, set_tp_group

    previous = get_tp_group()
    set_tp_group(TensorParallelGroup(rank, tp_size))
    try:
        yield
    finally:
        set_tp_group(previous)


@dataclass(slots=True)
class ReplicaPlan:
    """Every rank's plan; the replica allocates the smallest block count of any rank, in each of
    its ``attention_dp_size`` KV pools (one per attention group, data-parallel attention:
    ``workers/plan_dp.py``, whose details are in ``dp_attention``; one pool under plain TP)."""

    ranks: list[RankPlan]
    max_model_len: int
    notes: list[str] = field(default_factory=list)
    attention_dp_size: int = 1
    dp_attention: dict | None = None

    @property
    def kv_blocks(self) -> int:
        """Blocks of each pool (the smallest count of any rank)."""
        return min(rank.kv_blocks for rank in self.ranks)

    @property
    def kv_tokens(self) -> int:
        """The replica's KV capacity in tokens: every pool's blocks x block size."""
        return self.attention_dp_size * self.kv_blocks * self.ranks[0].block_size

    @property
    def fits(self) -> bool:
        return all(rank.fits for rank in self.ranks)

    @property
    def reason(self) -> str:
        """The first failing rank's reason ("" when it fits)."""
        return next((rank.reason for rank in self.ranks if not rank.fits), "")

    def to_json(self) -> str:
        """``{"fits", "ranks": [{"rank", "device_bytes", "weight_bytes", "kv_bytes_per_token",
        "kv_tokens", "fits", ...}], "kv_blocks", "kv_tokens", "max_model_len", "attention_dp_size",
        "dp_attention", ...}``: ``kv_tokens`` and ``max_concurrent_seqs`` are the replica's (all
        pools), a rank's ``kv_tokens`` its pool's."""
        first = self.ranks[0]
        return json.dumps({"fits": self.fits, "ranks": [rank.to_dict() for rank in self.ranks],
                           "kv_blocks": self.kv_blocks, "kv_tokens": self.kv_tokens,
                           "max_model_len": self.max_model_len,
                           "max_concurrent_seqs": self.attention_dp_size * (self.kv_blocks // first.blocks_per_seq),
                           "attention_dp_size": self.attention_dp_size, "dp_attention": self.dp_attention,
                           "reason": self.reason, "notes": self.notes})


def plan_replica(hf_config, ckpt: Checkpoint, config: PlanConfig, dtype: torch.dtype,
                 tensor_split: list[float] | None = None, weight_format=None,
                 speculative_tokens: int = 0) -> ReplicaPlan:
    """Plan every rank of a replica by building each rank's model on the meta device.

    Args:
        hf_config: the model's config (serving switches applied).
        ckpt: its checkpoint (:func:`open_for_plan`).
        config: the replica's settings (``device_bytes``: one rank's device).
        dtype: the resolved compute dtype.
        tensor_split: uneven per-rank shares (None: even).
        weight_format: CPU ranks' packing (:func:`workers.quantization.weight_format_for`), or None.
        speculative_tokens: with MTP drafts, rank 0 holds the draft model and its caches.

    Raises:
        ValueError: an unsupported architecture, a split the model cannot take, or no MTP layer.
    """
    from shardserve.workers.weight_loader import build_meta_model

    fmt = weight_format if config.device == "cpu" else None
    ranks = []
    for rank in range(config.tensor_parallel_size):
        with as_rank(rank, config.tensor_parallel_size):
            model = build_meta_model(hf_config, ckpt, tensor_split, dtype, keep_fp8=keeps_fp8(config.device),
                                     weight_format=fmt)
            draft = None
            if speculative_tokens and rank == 0:
                from shardserve.workers.models.mtp import build_mtp_meta_model

                draft = build_mtp_meta_model(hf_config, ckpt, dtype)
            ranks.append(plan_rank(model, config, rank, draft))
        del model
    return ReplicaPlan(ranks, config.max_model_len)


def check_plan(plan: RankPlan) -> None:
    """Raises :class:`DoesNotFitError` (``plan.reason``) unless the rank can start: its weights,
    reserves and one KV block fit (whether a whole ``max_model_len`` sequence fits is the
    coordinator's call: without ``--max-model-len`` it lowers the context to what the pool holds)."""
    if not plan.starts:
        raise DoesNotFitError(plan.reason)


def decode_graph_backend(mode: str, enforce_eager: bool, device: str, triton: bool) -> str | None:
    """How a runner runs decode steps: ``"cuda"`` (captured CUDA graphs), ``"replay"`` (the eager
    stand-in on fixed buffers: tests and dry runs) or None (eager).

    Args:
        mode: ``RunnerConfig.decode_graphs`` (``"auto"``, ``"replay"``, ``"off"``).
        enforce_eager: ``--enforce-eager``.
        device: ``"cuda"`` / ``"cpu"``.
        triton: the Triton kernels run (the torch references sync with the host: not capturable).
    """
    if mode == "replay":
        return "replay"
    if mode == "off" or enforce_eager or device != "cuda":
        return None
    # NOTE: hybrid models are captured too (recurrent states at fixed slots, workers/state_cache.py);
    # the torch references' decode paths have no host sync either, but their pair-wise MoE and
    # per-layer temporaries are sized for CPU: on CUDA, graphs run the kernels.
    return "cuda" if triton else None
