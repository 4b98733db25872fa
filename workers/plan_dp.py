"""The memory plan of a replica under data-parallel attention (issue 29; ``shardserve plan
--enable-dp-attention``).

The layout (SGLang's ``--enable-dp-attention``; ``workers/models/group_exchange.py``): the
replica's ``N`` ranks form ``D`` attention groups of ``G = N / D`` consecutive ranks. MLA and the
DSA indexer are split over the ``G`` ranks of a group exactly as plain TP splits them over ``G``
ranks (so at ``G = 1`` a rank holds all heads); the routed experts (whole experts), the shared
experts and dense MLP layers (intermediate dim) and the embedding and LM head (vocabulary) are split
over all ``N`` ranks. Each rank's model is built on the meta device in that layout, under planning
groups of the real sizes (:func:`as_dp_rank`), by the code ``serve`` loads with, so the weights are
what the rank will hold. Each group keeps its own KV + indexer cache pool, sized like a plain TP
rank's (every rank of a group holds the full latent of its group's tokens); the replica allocates
the smallest block count of any rank in every group, so its capacity is ``D x blocks x
block_size`` tokens, against ``blocks x block_size`` under plain TP, where every rank holds the same
latents.

Reserves follow the runtime: decode runs eagerly (no CUDA graphs: the exchanges' token counts
change every step); ``--max-num-batched-tokens`` and ``--max-num-seqs`` are the *replica's* step
budget, each group's scheduler gets ``1/D`` of them (as SGLang divides ``chunked_prefill_size``);
attention is planned at a group's share, and the layers split over all ranks run on every group's
tokens, i.e. the replica's budget, plus the exchange's gathered and reduce-scattered ``[N, tokens /
D, hidden]`` buffers. ``alltoall`` is planned the same way, an upper bound of what it receives.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from shardserve.workers.activation import dtype_bytes
from shardserve.workers.checkpoint import Checkpoint
from shardserve.workers.fp8 import keeps_fp8
from shardserve.workers.plan import PlanConfig, ReplicaPlan, as_rank, plan_rank


def routed_expert_bytes(model) -> dict[str, int]:
    """Bytes of a model's routed experts by storage format (its :class:`FusedExperts` modules)."""
    from shardserve.workers.models.moe import FusedExperts
    from shardserve.workers.weight_loader import weight_bytes_by_format

    out: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, FusedExperts):
            for name, size in weight_bytes_by_format(module).items():
                out[name] = out.get(name, 0) + size
    return out


def attention_bytes(model) -> int:
    """Bytes of a model's attention sublayers (MLA with its DSA indexer: ``self_attn`` of every layer)."""
    from shardserve.workers.weight_loader import weight_bytes_by_format

    return sum(sum(weight_bytes_by_format(layer.self_attn).values()) for layer in model.model.layers)


@contextmanager
def as_dp_rank(rank: int, num_ranks: int, num_groups: int):
    """Build models as replica rank ``rank`` of ``num_ranks`` in ``num_groups`` attention groups:
    planning groups (no communicator) of the runtime's sizes, the attention group as the TP group
    and all ranks as the expert group (``workers/distributed.py``); the process's groups are put back.

    Raises:
        ValueError: ``num_groups`` does not divide ``num_ranks``.
    """
    from shardserve.workers.distributed import (TensorParallelGroup, attention_group_layout, get_expert_group,
                                                get_tp_group, set_tp_group)

    _, local, size = attention_group_layout(rank, num_ranks, num_groups)
    previous, previous_experts = get_tp_group(), get_expert_group()
    set_tp_group(TensorParallelGroup(local, size), TensorParallelGroup(rank, num_ranks))
    try:
        yield
    finally:
        set_tp_group(previous, None if previous_experts is previous else previous_experts)


def _unit_counts(hf_config, rank: int, size: int) -> tuple[int, ...]:
    """How many heads, MLP columns, routed experts, shared-expert columns and vocabulary rows rank
    ``rank`` of an even ``size``-way split holds (``workers/models/deepseek_v32.py``)."""
    from shardserve.workers.partition import split_units

    shared = hf_config.moe_intermediate_size * (getattr(hf_config, "n_shared_experts", None) or 0)
    units = (hf_config.num_attention_heads, hf_config.intermediate_size, hf_config.n_routed_experts, shared,
             hf_config.vocab_size)
    return tuple(split_units(count, size, None)[rank][1] if count else 0 for count in units)


def exchange_reserve(model, num_groups: int, num_ranks: int, tokens: int, triton: bool) -> int:
    """Bytes the token exchange adds to a rank's step reserve when each of ``num_groups`` groups
    computes ``tokens`` tokens: the larger of a MoE and a dense MLP sublayer over every group's
    ``num_groups x tokens`` tokens instead of ``tokens``, plus the gathered ``[num_ranks, tokens,
    hidden]`` parts, the ``[num_groups x tokens, hidden]`` gathered rows and the ``[num_ranks,
    tokens, hidden]`` reduce-scatter buffer (``workers/models/group_exchange.py``). 0 for one group."""
    # NOTE: activation.py's per-sublayer terms; the exchange itself is the runtime's (issue 29)
    from shardserve.workers.activation import _mlp, _moe

    if num_groups == 1:
        return 0
    hidden, d, more = model.config.hidden_size, dtype_bytes(model), 0
    for layer in model.model.layers:
        mlp, grow = layer.mlp, None
        if hasattr(mlp, "experts"):
            grow = lambda t: _moe(mlp, t, hidden, d, triton)   # noqa: E731
        else:
            grow = lambda t: _mlp(mlp, t, hidden, d, triton)   # noqa: E731
        more = max(more, grow(num_groups * tokens) - grow(tokens))
    return more + (2 * num_ranks + num_groups) * tokens * hidden * d


def plan_dp_replica(hf_config, ckpt: Checkpoint, config: PlanConfig, dtype: torch.dtype, attention_dp_size: int,
                    weight_format=None, speculative_tokens: int = 0) -> ReplicaPlan:
    """Plan every rank of a replica under data-parallel attention, and the same replica under plain
    TP for comparison (``dp_attention["plain_tp_kv_tokens"]``).

    Args:
        hf_config: the model's config (serving switches applied); MLA + MoE (DeepSeek family).
        ckpt: its checkpoint (:func:`workers.plan.open_for_plan`).
        config: the replica's settings; ``tensor_parallel_size`` is ``N``; ``max_num_seqs`` and
            ``max_num_batched_tokens`` are the replica's step budget (each group gets ``1/D``).
        dtype: the resolved compute dtype.
        attention_dp_size: ``D``, dividing ``N``.
        weight_format: the CPU packing (:func:`workers.quantization.weight_format_for`) or None.
        speculative_tokens: with MTP drafts, the first rank of each group holds a draft model (each
            group drafts for its own requests).

    Returns:
        a :class:`ReplicaPlan` with ``attention_dp_size = D``: ``kv_tokens`` is the replica's
        capacity (``D`` pools), ``ranks[r].kv_tokens`` one group's pool, and ``dp_attention`` the
        per-rank split of the weights, the exchange reserve and the plain-TP figures.

    Raises:
        ValueError: ``D`` does not divide ``N``, a budget below one per group, a split the model
            cannot take, or no MTP layer.
    """
    from shardserve.workers.weight_loader import build_meta_model

    num_ranks = config.tensor_parallel_size
    if attention_dp_size < 1 or num_ranks % attention_dp_size:
        raise ValueError(f"--attention-dp-size {attention_dp_size} must divide --tensor-parallel-size {num_ranks}")
    group_size = num_ranks // attention_dp_size
    seqs, tokens = config.max_num_seqs // attention_dp_size, config.max_num_batched_tokens // attention_dp_size
    if not seqs or not tokens:
        raise ValueError(f"--max-num-seqs {config.max_num_seqs} / --max-num-batched-tokens "
                         f"{config.max_num_batched_tokens} leave nothing for each of {attention_dp_size} "
                         "attention groups")
    # one group's step; eager decode under DP attention
    dp_config = dataclasses.replace(config, decode_graphs="off", max_num_seqs=seqs, max_num_batched_tokens=tokens)
    keep_fp8 = keeps_fp8(config.device)

    models: dict[tuple, object] = {}

    def build(rank: int, dp: bool):
        """Rank ``rank``'s model, in the DP-attention layout or plain TP=N; ranks with the same unit
        counts share one build (their weights and reserves are equal; only their slices' offsets differ)."""
        key = (dp, rank % group_size if dp else None, _unit_counts(hf_config, rank, num_ranks))
        if key not in models:
            with as_dp_rank(rank, num_ranks, attention_dp_size) if dp else as_rank(rank, num_ranks):
                models[key] = build_meta_model(hf_config, ckpt, None, dtype, keep_fp8=keep_fp8,
                                               weight_format=weight_format)
        return models[key]

    ranks, plain, routed, attention, rest, reserves = [], [], [], [], [], []
    for rank in range(num_ranks):
        plain.append(plan_rank(build(rank, dp=False), config, rank))   # the comparison
        model = build(rank, dp=True)
        draft = None
        if speculative_tokens and rank % group_size == 0:
            from shardserve.workers.models.mtp import build_mtp_meta_model

            with as_rank(0, group_size):
                draft = build_mtp_meta_model(hf_config, ckpt, dtype)
        plan = plan_rank(model, dp_config, rank, draft)
        routed.append(sum(routed_expert_bytes(model).values()))
        attention.append(attention_bytes(model))
        rest.append(plan.weight_bytes - routed[-1] - attention[-1])
        reserves.append(exchange_reserve(model, attention_dp_size, num_ranks, tokens, config.triton))
        plan.activation_bytes += reserves[-1]
        ranks.append(plan.solve(dp_config))
    plain_blocks = min(rank.kv_blocks for rank in plain)
    replica = ReplicaPlan(ranks, config.max_model_len, attention_dp_size=attention_dp_size)
    replica.dp_attention = {
        "attention_dp_size": attention_dp_size, "group_size": group_size,
        "group_max_num_batched_tokens": tokens, "group_max_num_seqs": seqs,
        "attention_bytes": attention, "routed_expert_bytes": routed, "other_weight_bytes": rest,
        "exchange_reserve_bytes": reserves,
        "kv_tokens_per_group": replica.kv_blocks * config.block_size,
        "plain_tp_weight_bytes": [rank.weight_bytes for rank in plain],
        "plain_tp_kv_tokens": plain_blocks * config.block_size,
        "plain_tp_fits": all(rank.fits for rank in plain)}
    return replica


def summary_lines(plan: ReplicaPlan) -> list[str]:
    """The lines ``shardserve plan`` prints under its table for a DP-attention plan (none for a
    plain-TP one): what a rank holds, and the replica's KV capacity against plain TP's."""
    from shardserve.workers.plan import size_text

    info = plan.dp_attention
    if not info:
        return []
    first, num_ranks = plan.ranks[0], len(plan.ranks)
    groups, size, plain = info["attention_dp_size"], info["group_size"], info["plain_tp_kv_tokens"]
    ratio = f"{plan.kv_tokens / plain:.2f}x" if plain else "plain TP holds no block"
    return [
        f"DP attention: {groups} attention group(s) of {size} rank(s); per rank: attention (MLA + indexer, 1/{size}) "
        f"{size_text(info['attention_bytes'][0])} + routed experts {size_text(info['routed_expert_bytes'][0])} "
        f"+ dense MLPs, shared experts, embedding, LM head (1/{num_ranks}), norms and routers "
        f"{size_text(info['other_weight_bytes'][0])} = {size_text(first.weight_bytes)} (plain TP={num_ranks}: "
        f"{size_text(info['plain_tp_weight_bytes'][0])}); step budget per group: "
        f"{info['group_max_num_batched_tokens']} tokens, {info['group_max_num_seqs']} sequences; exchange reserve "
        f"{size_text(info['exchange_reserve_bytes'][0])}",
        f"KV cache per replica: {groups} group(s) x {plan.kv_blocks} blocks x {first.block_size} = {plan.kv_tokens} "
        f"tokens; plain TP={num_ranks}: {plain} tokens ({ratio})"]
