"""The memory plan of a replica under data-parallel attention (issue 29; ``shardserve plan
--enable-dp-attention``).

The layout (SGLang's ``--enable-dp-attention``): the replica's ``N`` ranks form ``D`` attention
groups of ``G = N / D`` consecutive ranks. Inside a group everything but the routed experts -- MLA
and the DSA indexer, the dense MLP layers, the shared experts, the router, the embedding and the LM
head -- is split over the ``G`` ranks exactly as plain TP splits it over ``G`` ranks; the routed
experts are split over all ``N`` ranks in whole experts (expert parallel). So rank ``r`` holds

    weights(r) = weights of rank ``r % G`` of a plain TP=G model, routed experts excluded
               + the routed experts of rank ``r`` of a plain TP=N model,

which is what this module sums, from two meta-device builds (the code ``serve`` loads with; see
:mod:`workers.plan`). Each group keeps its own KV + indexer cache pool, sized like a plain TP rank's
(every rank of a group holds the full latent of its group's tokens); the replica allocates the
smallest block count of any rank in every group, so its capacity is ``D x blocks x block_size``
tokens, against ``blocks x block_size`` under plain TP, where every rank holds the same latents.

Reserves follow the runtime: decode runs eagerly (no CUDA graphs: the MoE exchange's token counts
change every step), ``--max-num-batched-tokens`` is each group's step budget, and a MoE layer under
``allgather`` routes every group's tokens on every rank (``D x`` the tokens, plus the gathered and
reduce-scattered ``[N, tokens, hidden]`` buffers); ``alltoall`` is planned the same way, an upper
bound of what it receives.
"""

from __future__ import annotations

import dataclasses

import torch

from shardserve.workers.activation import dtype_bytes
from shardserve.workers.checkpoint import Checkpoint
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


def _unit_counts(hf_config, rank: int, size: int) -> tuple[int, ...]:
    """How many heads, MLP columns, routed experts, shared-expert columns and vocabulary rows rank
    ``rank`` of a plain TP=``size`` DeepSeek-family model holds (``workers/models/deepseek_v32.py``)."""
    from shardserve.workers.partition import split_units

    shared = hf_config.moe_intermediate_size * (getattr(hf_config, "n_shared_experts", None) or 0)
    units = (hf_config.num_attention_heads, hf_config.intermediate_size, hf_config.n_routed_experts, shared,
             hf_config.vocab_size)
    return tuple(split_units(count, size, None)[rank][1] if count else 0 for count in units)


def _moe_exchange_reserve(model, num_groups: int, num_ranks: int, tokens: int, triton: bool) -> int:
    """Bytes a MoE layer's token exchange adds to a rank's step reserve: the layer over the
    tokens of all ``num_groups`` groups instead of its own ``tokens``, and the ``[num_ranks,
    tokens, hidden]`` all-gather and reduce-scatter buffers (``workers/models/moe_exchange.py``)."""
    # NOTE: activation.py's per-sublayer term; the exchange itself is the runtime's (issue 29)
    from shardserve.workers.activation import _moe

    moe = next((layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")), None)
    if moe is None or num_groups == 1:
        return 0
    hidden, d = model.config.hidden_size, dtype_bytes(model)
    more = _moe(moe, num_groups * tokens, hidden, d, triton) - _moe(moe, tokens, hidden, d, triton)
    return more + 2 * num_ranks * tokens * hidden * d


def plan_dp_replica(hf_config, ckpt: Checkpoint, config: PlanConfig, dtype: torch.dtype, attention_dp_size: int,
                    weight_format=None, speculative_tokens: int = 0) -> ReplicaPlan:
    """Plan every rank of a replica under data-parallel attention, and the same replica under plain
    TP for comparison (``dp_attention["plain_tp_kv_tokens"]``).

    Args:
        hf_config: the model's config (serving switches applied); MLA + MoE (DeepSeek family).
        ckpt: its checkpoint (:func:`workers.plan.open_for_plan`).
        config: the replica's settings; ``tensor_parallel_size`` is ``N``.
        dtype: the resolved compute dtype.
        attention_dp_size: ``D``, dividing ``N``.
        weight_format: the CPU packing (:func:`workers.quantization.weight_format_for`) or None.
        speculative_tokens: with MTP drafts, the first rank of each group holds a draft model (each
            group drafts for its own requests).

    Returns:
        a :class:`ReplicaPlan` with ``attention_dp_size = D``: ``kv_tokens`` is the replica's
        capacity (``D`` pools), ``ranks[r].kv_tokens`` one group's pool, and ``dp_attention`` the
        per-rank split of the weights and the plain-TP figures.

    Raises:
        ValueError: ``D`` does not divide ``N``, a split the model cannot take, or no MTP layer.
    """
    from shardserve.workers.weight_loader import build_meta_model

    num_ranks = config.tensor_parallel_size
    if attention_dp_size < 1 or num_ranks % attention_dp_size:
        raise ValueError(f"--attention-dp-size {attention_dp_size} must divide --tensor-parallel-size {num_ranks}")
    group_size = num_ranks // attention_dp_size
    dp_config = dataclasses.replace(config, decode_graphs="off")   # eager decode under DP attention
    keep_fp8 = config.device == "cuda"

    models: dict[tuple, object] = {}

    def build(rank: int, size: int):
        """Rank ``rank`` of a plain TP=``size`` model; ranks with the same unit counts share one build
        (their weights and reserves are equal; only the offsets of their slices differ)."""
        key = (size, _unit_counts(hf_config, rank, size))
        if key not in models:
            with as_rank(rank, size):
                models[key] = build_meta_model(hf_config, ckpt, None, dtype, keep_fp8=keep_fp8,
                                               weight_format=weight_format)
        return models[key]

    ranks, plain, routed, rest = [], [], [], []
    for rank in range(num_ranks):
        full = build(rank, num_ranks)                      # plain TP=N: its routed experts, and the comparison
        plain.append(plan_rank(full, config, rank))
        local = build(rank % group_size, group_size)       # plain TP=G: everything else
        draft = None
        if speculative_tokens and rank % group_size == 0:
            from shardserve.workers.models.mtp import build_mtp_meta_model

            with as_rank(0, group_size):
                draft = build_mtp_meta_model(hf_config, ckpt, dtype)
        plan = plan_rank(local, dp_config, rank, draft)
        weights = dict(plan.weight_bytes_by_dtype)
        for name, size in routed_expert_bytes(local).items():
            weights[name] -= size
        rest.append(sum(weights.values()))
        mine = routed_expert_bytes(full)
        routed.append(sum(mine.values()))
        for name, size in mine.items():
            weights[name] = weights.get(name, 0) + size
        plan.weight_bytes_by_dtype = {name: size for name, size in weights.items() if size}
        plan.activation_bytes += _moe_exchange_reserve(local, attention_dp_size, num_ranks,
                                                       min(config.max_num_batched_tokens, config.max_model_len),
                                                       config.triton)
        ranks.append(plan.solve(dp_config))
    plain_blocks = min(rank.kv_blocks for rank in plain)
    replica = ReplicaPlan(ranks, config.max_model_len, attention_dp_size=attention_dp_size)
    replica.dp_attention = {
        "attention_dp_size": attention_dp_size, "group_size": group_size,
        "routed_expert_bytes": routed, "other_weight_bytes": rest,
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
        f"DP attention: {groups} attention group(s) of {size} rank(s); per rank: routed experts "
        f"{size_text(info['routed_expert_bytes'][0])} (1/{num_ranks} of them) + attention, dense MLPs, shared "
        f"experts, embedding and LM head {size_text(info['other_weight_bytes'][0])} (1/{size}) = "
        f"{size_text(first.weight_bytes)} (plain TP={num_ranks}: {size_text(info['plain_tp_weight_bytes'][0])})",
        f"KV cache per replica: {groups} group(s) x {plan.kv_blocks} blocks x {first.block_size} = {plan.kv_tokens} "
        f"tokens; plain TP={num_ranks}: {plain} tokens ({ratio})"]
