"""One rank's model, paged KV cache and per-request state; executes step plans.

Common path only (vLLM V2 runner's rule): turn a :class:`StepPlan` into packed input tensors and
attention metadata, run the forward, compute logits for the rows that sample, and (rank 0) sample.
Features live in helpers: the sampler, the cache allocator, the model classes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from shardserve.workers.checkpoint import GGUFCheckpoint, open_checkpoint
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.forward_context import AttentionMetadata, forward_context
from shardserve.workers.messages import SamplingOptions, StepPlan, StepResult
from shardserve.workers.model_source import ModelFiles
from shardserve.workers.quantization import WeightFormat, resolve_cpu_dtype, weight_format_for
from shardserve.workers.sampler import sample, sample_with_drafts, sampled_tokens
from shardserve.workers.weight_loader import build_model

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerConfig:
    """How a runner builds its model and cache (same on every rank)."""

    block_size: int = 16                 # tokens per KV block
    kv_cache_bytes: int = 1 << 30        # cache budget on this rank, bytes
    num_blocks: int | None = None        # overrides kv_cache_bytes when set
    tensor_split: list[float] | None = None
    dtype: str = "auto"                  # auto | bfloat16 | float16 | float32 (workers/quantization.py)
    quantization: str = "none"           # none | int8 | int4: pack float weights at load time
    seed: int = 0                        # seed of the generator for unseeded requests


def weight_format_of(ckpt, dtype: str, quantization: str) -> tuple[torch.dtype, WeightFormat | None]:
    """Compute dtype and weight format of a run on CPU (the ``--dtype auto`` rule is
    :func:`workers.quantization.resolve_cpu_dtype`)."""
    is_gguf = isinstance(ckpt, GGUFCheckpoint)
    resolved = resolve_cpu_dtype(dtype, ckpt.matrix_types() if is_gguf else None, quantization)
    return resolved, weight_format_for(resolved, quantization, is_gguf)


def cache_bytes(layers, num_blocks: int, block_size: int) -> int:
    """Bytes the caches of ``layers`` (attention modules with ``cache_spec``) take for ``num_blocks``."""
    return sum(math.prod(shape) * dtype.itemsize for layer in layers
               for shape, dtype in layer.cache_spec(num_blocks, block_size))


def allocate_caches(layers, num_blocks: int, block_size: int) -> int:
    """Give every layer zero-filled cache tensors as its ``cache_spec`` asks; returns their bytes.

    All of them are views of one anonymous ``mmap``: the OS hands out zero pages that become
    resident only when a block is first written (``torch.zeros`` writes every byte, making the
    worst-case cache resident at start; numpy's ``zeros`` asks for 2 MiB huge pages, so each
    layer's first token made 4 MiB resident)."""
    import mmap

    specs = [layer.cache_spec(num_blocks, block_size) for layer in layers]
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
    """Owns this rank's model shard and KV cache.

    Args:
        files: resolved model files.
        hf_config: transformers config of the model.
        config: cache/parallel settings.

    Attributes:
        num_blocks: KV blocks allocated on this rank.
        weight_bytes / cache_bytes: memory held by weights and by the KV cache on this rank.
    """

    def __init__(self, files: ModelFiles, hf_config, config: RunnerConfig, progress: bool = True) -> None:
        self.config = config
        self.hf_config = hf_config
        ckpt = open_checkpoint(files.path)
        self.dtype, weight_format = weight_format_of(ckpt, config.dtype, config.quantization)
        self.model, self.weight_bytes = build_model(hf_config, ckpt, config.tensor_split, self.dtype, progress,
                                                    weight_format)
        del ckpt
        self.block_size = config.block_size
        self.requests: dict[str, RequestState] = {}
        self.generator = torch.Generator().manual_seed(config.seed)
        self.num_blocks, self.cache_bytes = 0, 0
        self.last_hidden_states: torch.Tensor | None = None   # [T, hidden] of the last plan with return_hidden
        if config.num_blocks is not None:
            self.allocate_kv_cache(config.num_blocks)

    @property
    def bytes_per_block(self) -> int:
        """KV cache bytes one block takes on this rank, over all layers."""
        return cache_bytes(self.model.attention_layers(), 1, self.block_size)

    def max_num_blocks(self) -> int:
        """Blocks that fit this rank's budget (``num_blocks`` when set, else ``kv_cache_bytes``)."""
        return self.config.num_blocks or max(1, self.config.kv_cache_bytes // self.bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks in every layer's cache tensors (every rank gets the same
        count: the smallest any rank can hold), zero-filled."""
        self.num_blocks = num_blocks
        self.cache_bytes = allocate_caches(self.model.attention_layers(), num_blocks, self.block_size)
        logger.info("rank %d: weights %.1f MiB, KV cache %.1f MiB in %d blocks of %d tokens",
                    get_tp_group().tp_rank, self.weight_bytes / 2**20, self.cache_bytes / 2**20,
                    self.num_blocks, self.block_size)

    def _apply_plan(self, plan: StepPlan) -> None:
        apply_request_diffs(self.requests, plan.finished_req_ids, plan.new_requests, plan.scheduled)

    def _prepare_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        input_ids, positions, query_start, seq_lens, logits_rows = [], [], [0], [], []
        for sched in plan.scheduled:
            num = len(sched.token_ids)
            input_ids.extend(sched.token_ids)
            positions.extend(range(sched.start_pos, sched.start_pos + num))
            query_start.append(query_start[-1] + num)
            seq_lens.append(sched.start_pos + num)
            if sched.sample:   # the last row, and one more per draft token being verified
                logits_rows.extend(range(query_start[-1] - 1 - sched.num_spec_tokens, query_start[-1]))
        tables = [self.requests[s.req_id].block_ids for s in plan.scheduled]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(tables)),
                                               torch.tensor([len(s.token_ids) for s in plan.scheduled]))
        blocks = block_tables[seq_of_token, positions_t // self.block_size].long()
        meta = AttentionMetadata(
            slot_mapping=blocks * self.block_size + positions_t % self.block_size,
            positions=positions_t,
            query_start_loc=torch.tensor(query_start, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_tables,
            max_query_len=max(len(s.token_ids) for s in plan.scheduled),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(input_ids, dtype=torch.int64), meta, torch.tensor(logits_rows, dtype=torch.int64)

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> torch.Tensor:
        """Apply ``plan`` and run the forward; float32 logits ``[rows, vocab]``, one row per sampling
        request plus one per draft token it verifies."""
        self._apply_plan(plan)
        self.last_hidden_states = None
        if not plan.scheduled:
            return torch.empty(0, self.hf_config.vocab_size)
        input_ids, meta, logits_rows = self._prepare_inputs(plan)
        with forward_context(meta):
            hidden = self.model(input_ids, meta.positions)
        if plan.return_hidden:
            self.last_hidden_states = hidden
        return self.model.compute_logits(hidden[logits_rows])

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step. Rank 0 returns the sampled tokens; other ranks return None."""
        logits = self.compute_logits(plan)
        if get_tp_group().tp_rank != 0:
            return None
        sampling = [s for s in plan.scheduled if s.sample]
        options = [self.requests[s.req_id].sampling for s in sampling]
        if any(s.num_spec_tokens for s in sampling):
            sampled = sample_with_drafts(logits, sampling, options, self.generator)
        else:
            tokens, logprobs = sample(logits, options, [s.output_index for s in sampling], self.generator)
            sampled = sampled_tokens([s.req_id for s in sampling], tokens, logprobs, options)
        return StepResult(sampled, logits if plan.return_logits else None, self.last_hidden_states)
