"""The profiling step: one forward of a given step shape on temporary caches, measured on CUDA.

:func:`run_step` runs any :class:`workers.activation.StepShape` (``B`` sequences each computing its
last ``T / B`` positions of an ``S``-token context) with the logits and the sampler's filtering over
``R`` rows. Its temporary caches hold only the step's blocks: each block table maps the whole
context onto them, so shapes are right and contents do not matter. The runner profiles the largest
step the scheduler can send (:meth:`StepShape.prefill`), the shape the activation reserve of
``workers/activation.py`` is planned for, so the profile is bounded by what a step can do and
checked against the plan: on CUDA :func:`measure_cuda` refuses to start a profile the free memory
cannot hold, and reports the measured peak above the weights and the memory held outside torch.
On CPU the same forward runs (tests and the dry run) but nothing is measured.
"""

from __future__ import annotations

import torch

from shardserve.workers.activation import StepShape
from shardserve.workers.device import DoesNotFitError, gib
from shardserve.workers.forward_context import forward_context
from shardserve.workers.sampler import filter_logits
from shardserve.workers.state_cache import SeqGroup, StateMetadata
from shardserve.workers.step_inputs import DeviceStager, HostBatch, device_batch


def step_blocks(shape: StepShape, block_size: int) -> int:
    """Physical blocks :func:`step_batch` writes: every sequence's new tokens, a block more each."""
    return shape.num_seqs * (-(-shape.max_query_len // block_size) + 1)


def step_batch(shape: StepShape, block_size: int) -> HostBatch:
    """The host inputs of ``shape``: sequence ``b`` computes its last ``T / B`` positions of an
    ``S``-token context; its block table maps the context onto its own :func:`step_blocks` share,
    cycling (no two sequences write one slot)."""
    queries = [shape.num_tokens // shape.num_seqs + (b < shape.num_tokens % shape.num_seqs)
               for b in range(shape.num_seqs)]
    width = -(-shape.max_seq_len // block_size)
    own = step_blocks(shape, block_size) // shape.num_seqs
    ids, positions, slots, starts, tables, rows = [], [], [], [0], [], []
    for b, count in enumerate(queries):
        table = [b * own + i % own for i in range(width)]
        span = range(shape.max_seq_len - count, shape.max_seq_len)
        ids += [0] * count
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        starts.append(starts[-1] + count)
        tables.append(table)
        rows.append(starts[-1] - 1)
    return HostBatch(ids, positions, slots, starts, [shape.max_seq_len] * shape.num_seqs, tables, rows,
                     max(queries), shape.max_seq_len)


@torch.inference_mode()
def run_step(model, device: torch.device, shape: StepShape, block_size: int, allocate) -> int:
    """Run one step of ``shape`` on temporary caches (and one recurrent-state slot per sequence for
    hybrid models), with the LM head and the sampler's filtering over ``shape.num_logit_rows``
    rows; then free the caches.

    Args:
        model: the loaded model (``attention_layers()``, ``compute_logits``).
        device: where it lives.
        shape: the step.
        block_size: tokens per block.
        allocate: ``allocate(layers, num_blocks) -> bytes``, the runner's cache allocator.

    Returns:
        bytes of the temporary caches (part of a measured peak, not activation memory).
    """
    layers = model.attention_layers()
    state_layers = getattr(model, "state_layers", list)()
    cache_bytes = allocate(layers, step_blocks(shape, block_size))
    cache_bytes += allocate(state_layers, shape.num_seqs) if state_layers else 0
    try:
        host = step_batch(shape, block_size)
        input_ids, meta, rows = device_batch(host, DeviceStager(device))
        if state_layers:   # slot b for sequence b (contents do not matter); decode steps run the recurrent rule
            cu_seqlens = torch.tensor(host.query_start_loc, dtype=torch.int32, device=device)
            slots = torch.arange(shape.num_seqs, dtype=torch.int32, device=device)
            group = SeqGroup(None, cu_seqlens, slots)
            chunked = shape.max_query_len > 1
            meta.state = StateMetadata(cu_seqlens, slots, group if chunked else None, None if chunked else group,
                                       keep=False)
        with forward_context(meta):
            hidden = model(input_ids, meta.positions)
        picked = hidden[rows]                                                      # [B, hidden]
        index = torch.arange(shape.num_logit_rows, device=device) % picked.shape[0]
        logits = model.compute_logits(picked[index])                               # [R, vocab]
        ones = torch.ones(shape.num_logit_rows, device=device)
        filter_logits(logits, ones.long(), ones * 0.9, ones * 0.0).softmax(-1)
    finally:
        for layer in [*layers, *state_layers]:
            layer.kv_cache = tuple(torch.empty(0, device=device) for _ in layer.cache_spec(1, block_size))
    return cache_bytes


def measure_cuda(model, device: torch.device, shape: StepShape, block_size: int, allocate,
                 planned: int) -> tuple[int, int]:
    """Profile ``shape`` on CUDA.

    Args:
        model, device, shape, block_size, allocate: see :func:`run_step`.
        planned: the activation reserve planned for ``shape`` (bytes); the profile starts only
            when that much is free.

    Returns:
        ``(activation, outside)``: the step's peak allocation above what was allocated before it
        (less its temporary caches), and the device memory held outside torch's allocator after it
        (CUDA context, NCCL buffers, other processes), bytes.

    Raises:
        DoesNotFitError: less than ``planned`` is free, or the step ran out of memory.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    where = (f"{shape.num_tokens} tokens at the end of a {shape.max_seq_len}-token context, with weights "
             f"{gib(weights)} loaded ({gib(free)} of {gib(total)} free)")
    if planned > free:
        raise DoesNotFitError(f"the model does not fit on {device}: the profiling step ({where}) needs up to "
                              f"{gib(planned)} of activations; lower --max-num-batched-tokens or --max-model-len")
    torch.cuda.reset_peak_memory_stats(device)
    try:
        temp_cache = run_step(model, device, shape, block_size, allocate)
    except torch.cuda.OutOfMemoryError as exc:
        raise DoesNotFitError(f"the model does not fit on {device}: the profiling step ({where}) ran out of memory; "
                              "lower --max-num-batched-tokens or --max-model-len") from exc
    torch.cuda.synchronize(device)
    activation = max(0, torch.cuda.max_memory_allocated(device) - weights - temp_cache)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return activation, max(0, total - free - torch.cuda.memory_reserved(device))
