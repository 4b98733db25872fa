"""Routed-expert MoE with SwiGLU experts (DeepSeek-V3 / GLM-5 layout), as one fused op.

``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
``e = topk_ids[t, j]``. Expert ids outside ``[0, num_experts)`` are skipped: under expert
parallelism a rank passes the ids of experts it does not own as ``-1`` (or ``num_experts``, as
HF's ``DeepseekV3NaiveMoe`` does). Router, shared experts and the all-reduce stay with the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.kernels.dispatch import use_triton


# Graph-safe steps of up to this many tokens (every decode batch the graphs capture) run the pair-wise
# reference: no host sync, shapes fixed by the step's size. Others (prefill, CPU steps) go expert by expert.
PAIRWISE_MAX_TOKENS = 1024
# Bytes of gathered expert weights the pair-wise reference holds at once (it runs in chunks of pairs).
PAIRWISE_CHUNK_BYTES = 64 << 20


def fused_moe_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, graph_safe: bool = True) -> torch.Tensor:
    """Routed experts in torch, numerically HF transformers' ``DeepseekV3NaiveMoe``: each pair's
    expert output, times its routing weight, is rounded to ``hidden.dtype`` and added to its
    token's row in ascending expert order.

    Two regimes, the same sums:

    - ``graph_safe`` and at most :data:`PAIRWISE_MAX_TOKENS` tokens: each (token, slot) pair against
      its gathered expert weights (no host sync, no data-dependent shape: CUDA graphs may capture it);
    - otherwise per expert that got tokens, its rows through its weights in place (one host read of
      the per-expert counts). On CPU this is what runs: gathering a ``[2I, hidden]`` weight copy
      per pair made the pair-wise form 1.6x-5x slower from 1 to 32 tokens (demo model's experts,
      one run: 1.06 vs 0.61 ms at 2 tokens, 10.9 vs 2.1 ms at 32), which made every MTP verify row
      cost ~1 ms per MoE layer (issue 31).

    Args:
        hidden: ``[T, hidden]``.
        w13: ``[E, 2 * I, hidden]`` gate rows then up rows (HF ``gate_up_proj``).
        w2: ``[E, hidden, I]`` (HF ``down_proj``).
        topk_weights: ``[T, k]`` routing weights (float32 from the router; any float dtype).
        topk_ids: ``[T, k]`` int expert ids; ids outside ``[0, E)`` contribute nothing.
        graph_safe: the step may be captured by a CUDA graph (or checked as if it were).

    Returns:
        ``[T, hidden]`` in ``hidden.dtype``.
    """
    if graph_safe and hidden.shape[0] <= PAIRWISE_MAX_TOKENS:
        return _fused_moe_pairwise(hidden, w13, w2, topk_weights, topk_ids)
    return _fused_moe_grouped(hidden, w13, w2, topk_weights, topk_ids)


def _fused_moe_grouped(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """:func:`fused_moe_ref` expert by expert: pairs sorted by expert (stable), the counts read to
    the host once, each used expert's token rows through its weights, added in expert order."""
    top_k, num_experts = topk_ids.shape[1], w13.shape[0]
    expert = topk_ids.reshape(-1).long()
    expert = torch.where((expert >= 0) & (expert < num_experts), expert, num_experts)   # E = "not here"
    order = torch.argsort(expert, stable=True)                                           # [P] by expert
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts].tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros_like(hidden)
    start = 0
    for index, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        token_idx = pairs // top_k
        gate, up = F.linear(hidden[token_idx], w13[index]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, w2[index]) * weights[pairs, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out


def _fused_moe_pairwise(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """:func:`fused_moe_ref` pair by pair: ``[T, k]`` pairs gathered against their experts'
    weights in chunks of at most :data:`PAIRWISE_CHUNK_BYTES`, then summed per token in expert order."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    ids, order = topk_ids.long().sort(dim=-1, stable=True)                        # HF adds experts in id order
    weights = topk_weights.gather(1, order)
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, 0).reshape(-1)                                    # [P] (dropped: weight 0)
    weights = torch.where(valid, weights, 0).reshape(-1, 1)
    rows = hidden.repeat_interleave(top_k, dim=0)                                   # [P, hidden], pair p = t * k + j
    pair_out = torch.empty_like(rows)
    per_pair = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    chunk = max(1, PAIRWISE_CHUNK_BYTES // per_pair)
    for start in range(0, rows.shape[0], chunk):
        part = slice(start, start + chunk)
        expert = ids[part]
        gate_up = torch.bmm(w13[expert], rows[part, :, None]).squeeze(-1)          # [C, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(w2.dtype)
        pair_out[part] = (torch.bmm(w2[expert], act[:, :, None]).squeeze(-1) * weights[part]).to(hidden.dtype)
    pair_out = pair_out.view(num_tokens, top_k, -1)
    out = torch.zeros_like(hidden)
    for j in range(top_k):                                                          # rounded per add, as HF
        out = out + pair_out[:, j]
    return out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Device ops only (no host sync): the padded length uses the bound
    ``num_pairs + min(num_pairs, num_experts) * (block_m - 1)``.

    Args:
        topk_ids: ``[T, k]`` int expert ids (out-of-range ids are dropped).
        num_experts: ``E``.
        block_m: rows per grouped-GEMM tile.

    Returns:
        ``sorted_pair_ids [num_blocks * block_m]`` int32: pair index ``t * k + j`` grouped by
        expert, ``T * k`` marking padding; ``block_expert [num_blocks]`` int32: the expert of
        each tile of ``block_m`` rows, ``-1`` for unused tiles.
    """
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    expert = topk_ids.reshape(-1).long()
    expert = torch.where((expert >= 0) & (expert < num_experts), expert, num_experts)  # E = "not here"
    order = torch.argsort(expert, stable=True)                                        # [P]
    sorted_expert = expert[order]
    # scatter_add_, not bincount: bincount reads min/max back to the host on CUDA
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, expert, torch.ones_like(expert))                                           # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded.narrow(0, num_experts, 1).zero_()     # a kernel: `padded[E] = 0` is a host-to-device copy
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_expert]       # rank within its expert
    num_blocks = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)
    capacity = num_blocks * block_m
    dest = torch.where(sorted_expert < num_experts, padded_end[sorted_expert] - padded[sorted_expert] + rank,
                       capacity)                                                      # dropped pairs -> dump slot
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end[:num_experts].contiguous(), block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids[:capacity], block_expert


def dequantize_fp8_experts(weights: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                           dtype: torch.dtype) -> torch.Tensor:
    """``[E, rows, cols]`` FP8 expert weights with ``[E, ceil(rows / bo), ceil(cols / bi)]`` block
    scales -> ``[E, rows, cols]`` in ``dtype`` (dequantized in float32 first)."""
    from shardserve.kernels.fp8_linear import dequantize_fp8_weight

    return torch.stack([dequantize_fp8_weight(w, s, block_size).to(dtype) for w, s in zip(weights, scale_inv)])


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_size: tuple[int, int] | None = None, graph_safe: bool = True) -> torch.Tensor:
    """Dispatching fused MoE (:func:`kernels.fused_moe_triton.fused_moe_triton` or
    :func:`fused_moe_ref`, same contract; ``graph_safe`` picks the reference's regime, the Triton
    path never syncs).

    With ``w13_scale`` / ``w2_scale`` (``[E, ceil(rows / bo), ceil(cols / bi)]`` float32) the expert
    weights are ``float8_e4m3fn`` with DeepSeek-V3 block scales of ``block_size = (bo, bi)`` (``I``
    a multiple of ``bo``, so gate and up rows never share a scale block): the Triton kernels read
    them as FP8; the reference dequantizes them to ``hidden.dtype`` first.
    """
    if use_triton(hidden):
        from shardserve.kernels.fused_moe_triton import fused_moe_triton

        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_size)
    if w13_scale is not None:
        w13 = dequantize_fp8_experts(w13, w13_scale, block_size, hidden.dtype)
        w2 = dequantize_fp8_experts(w2, w2_scale, block_size, hidden.dtype)
    return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, graph_safe)
