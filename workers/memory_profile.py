"""How much device memory a rank's KV cache may take: one profiling forward, then vLLM's rule.

:func:`profile_forward` runs the largest step the scheduler can send, one sequence of
``min(max_num_batched_tokens, max_model_len)`` new tokens at the *end* of a ``max_model_len``
context (the attention and DSA-indexer intermediates grow with both the chunk and the context),
plus the logits and the sampler's sort over ``max_num_seqs`` rows. Its temporary caches hold only
the chunk's blocks: the block table maps the whole context onto them, so shapes are right and
contents do not matter. On CUDA the peak allocation above the weights is the activation memory
(:func:`measure_cuda`); on CPU the same forward runs (tests and the dry run) but nothing is
measured.
"""

from __future__ import annotations

import torch

from shardserve.workers.device import DoesNotFitError, MemoryPlan, cuda_cache_budget, gib
from shardserve.workers.forward_context import forward_context
from shardserve.workers.sampler import filter_logits
from shardserve.workers.state_cache import SeqGroup, StateMetadata
from shardserve.workers.step_inputs import DeviceStager, HostBatch, device_batch


def profile_batch(num_tokens: int, max_model_len: int, block_size: int, num_blocks: int) -> HostBatch:
    """One sequence computing its last ``num_tokens`` positions of ``max_model_len``, its table
    cycling over ``num_blocks`` physical blocks."""
    num_tokens = max(1, min(num_tokens, max_model_len))
    width = -(-max_model_len // block_size)
    table = [i % num_blocks for i in range(width)]
    positions = list(range(max_model_len - num_tokens, max_model_len))
    return HostBatch([0] * num_tokens, positions,
                     [table[p // block_size] * block_size + p % block_size for p in positions],
                     [0, num_tokens], [max_model_len], [table], [num_tokens - 1], num_tokens, max_model_len)


@torch.inference_mode()
def profile_forward(model, device: torch.device, block_size: int, max_num_batched_tokens: int,
                    max_model_len: int, max_num_seqs: int, allocate) -> int:
    """Run the worst-case step once on temporary caches, then free them.

    Args:
        model: the loaded model (``attention_layers()``, ``compute_logits``).
        device: where it lives.
        block_size: tokens per block.
        max_num_batched_tokens / max_model_len / max_num_seqs: the scheduler's limits.
        allocate: ``allocate(layers, num_blocks) -> bytes``, the runner's cache allocator.

    Returns:
        bytes of the temporary caches (part of the measured peak, not activation memory).
    """
    num_tokens = min(max_num_batched_tokens, max_model_len)
    num_blocks = -(-num_tokens // block_size) + 1
    layers = model.attention_layers()
    state_layers = getattr(model, "state_layers", list)()   # hybrid models: one recurrent-state slot
    cache_bytes = allocate(layers, num_blocks) + (allocate(state_layers, 1) if state_layers else 0)
    try:
        host = profile_batch(num_tokens, max_model_len, block_size, num_blocks)
        input_ids, meta, rows = device_batch(host, DeviceStager(device))
        if state_layers:   # the chunk runs the chunked rule from slot 0 (contents do not matter)
            cu_seqlens = torch.tensor([0, len(host.input_ids)], dtype=torch.int32, device=device)
            slots = torch.zeros(1, dtype=torch.int32, device=device)
            meta.state = StateMetadata(cu_seqlens, slots, SeqGroup(None, cu_seqlens, slots), None, keep=False)
        with forward_context(meta):
            hidden = model(input_ids, meta.positions)
        logits = model.compute_logits(hidden[rows].expand(max_num_seqs, -1))      # [max_num_seqs, vocab]
        ones = torch.ones(max_num_seqs, device=device)
        filter_logits(logits, ones.long(), ones * 0.9, ones * 0.0).softmax(-1)
    finally:
        for layer in [*layers, *state_layers]:
            layer.kv_cache = tuple(torch.empty(0, device=device) for _ in layer.cache_spec(1, block_size))
    return cache_bytes


def measure_cuda(model, device: torch.device, utilization: float, bytes_per_block: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, allocate) -> MemoryPlan:
    """The rank's :class:`MemoryPlan` on CUDA: weights = memory allocated before profiling,
    activation = the profiling forward's peak above that, other = used outside torch's allocator.

    Raises:
        DoesNotFitError: the profiling forward ran out of memory, or nothing is left for one block.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        temp_cache = profile_forward(model, device, block_size, max_num_batched_tokens, max_model_len, max_num_seqs,
                                     allocate)
    except torch.cuda.OutOfMemoryError as exc:
        free, total = torch.cuda.mem_get_info(device)
        raise DoesNotFitError(
            f"the model does not fit on {device}: the profiling forward ({max_num_batched_tokens} tokens at the end "
            f"of a {max_model_len}-token context) ran out of memory with weights {gib(weights)} loaded "
            f"({gib(free)} of {gib(total)} free); lower --max-num-batched-tokens or --max-model-len") from exc
    torch.cuda.synchronize(device)
    activation = max(0, torch.cuda.max_memory_allocated(device) - weights - temp_cache)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, total - free - torch.cuda.memory_reserved(device))
    return cuda_cache_budget(total, utilization, weights, activation, other, bytes_per_block, str(device))
