"""DeepSeek-V3 MoE: sigmoid router with group-limited top-k, routed + shared experts, TP by experts.

Routing follows transformers' ``DeepseekV3TopkRouter`` (DeepSeek-V3 report, Sec. 2.1.2):
``s = sigmoid(x W_g^T)``; selection uses ``s + e_score_correction_bias`` (the bias only picks
experts, it never weights them): the ``topk_group`` groups with the largest sum of their top-2
biased scores are kept, then the ``num_experts_per_tok`` best experts among them; their weights
are the unbiased ``s``, normalized to sum 1 when ``norm_topk_prob``, times
``routed_scaling_factor``.

Tensor parallel (DESIGN.md): routed experts are split across ranks in whole experts (possibly
unevenly), the router is replicated, shared experts split their intermediate dim like a dense
MLP. Each rank sums its local experts' and its shared-expert slice's partial outputs, and the
layer does one all-reduce. With data-parallel attention the routed experts and the shared experts'
intermediate dim span every rank of the replica, and the layer exchanges tokens between the
attention groups instead (``workers/models/moe_exchange.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels import fused_moe, silu_and_mul
from shardserve.workers.checkpoint import LazyTensor
from shardserve.workers.compilation import opaque_call, tp_all_reduce
from shardserve.workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardserve.workers.sync_guard import guarded


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with its intermediate dim split across ranks.

    Args:
        hidden_size: model width.
        intermediate_size: full intermediate size.
        inter_range: ``(start, size)`` of this rank's intermediate slice.
        reduce_output: all-reduce the down projection (False: the caller fuses the reduce).

    Shapes: ``[T, hidden_size] -> [T, hidden_size]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, inter_range: tuple[int, int],
                 reduce_output: bool, dtype: torch.dtype) -> None:
        super().__init__()
        start, size = inter_range
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [(intermediate_size, start, size), (intermediate_size, start, size)], dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, start, size,
                                           reduce_output=reduce_output, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class TopkRouter(nn.Module):
    """Replicated router (``mlp.gate``): weight ``[E, hidden]`` and ``e_score_correction_bias [E]``,
    both float32 as in HF.

    Shapes: ``hidden [T, hidden] -> (weights [T, k] float32, expert_ids [T, k] int64)``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = config.n_group or 1
        self.topk_groups = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        assert self.num_experts % self.num_groups == 0, \
            f"n_routed_experts={self.num_experts} not divisible by n_group={self.num_groups}"
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden.float(), self.weight.float()).sigmoid()           # [T, E]
        biased = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.num_groups
        group_scores = biased.view(-1, self.num_groups, per_group).topk(2, dim=-1).values.sum(-1)   # [T, G]
        group_idx = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
        expert_ids = biased.topk(self.top_k, dim=-1, sorted=False).indices           # [T, k]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids


class FusedExperts(nn.Module):
    """This rank's routed experts as stacked weights, run by :func:`kernels.fused_moe` (one
    Triton grouped GEMM per projection on GPU; the per-expert torch loop on CPU).

    Args:
        hidden_size: model width ``H``.
        intermediate_size: ``moe_intermediate_size`` ``I`` of one expert.
        expert_range: ``(first_expert, num_local_experts)``: global expert ids this rank holds.
        dtype: parameter dtype.

    Parameters (vLLM's ``FusedMoE`` layout):
        ``w13_weight [E_local, 2I, H]``: each local expert's ``gate_proj`` rows then ``up_proj`` rows.
        ``w2_weight [E_local, H, I]``: each local expert's ``down_proj``.
    Both name their checkpoint tensors ``experts.{global_id}.{gate,up,down}_proj.weight`` through
    ``checkpoint_parts`` (read by :func:`workers.weight_loader.checkpoint_sources`), so a rank reads
    only its own experts.

    Shapes: ``forward(hidden [T, H], weights [T, k] float32, expert_ids [T, k] int64 global ids)
    -> [T, H]``, this rank's partial sum (ids of other ranks' experts contribute nothing).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, expert_range: tuple[int, int],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.first, self.count = expert_range
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(self.count, 2 * intermediate_size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.count, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)
        experts = range(self.first, self.first + self.count)
        # shard id of w13: 2 * local expert + (0 gate, 1 up); of w2: the local expert.
        self.w13_weight.checkpoint_parts = [(f"{e}.{proj}.weight", 2 * i + half) for i, e in enumerate(experts)
                                            for half, proj in enumerate(("gate_proj", "up_proj"))]
        self.w2_weight.checkpoint_parts = [(f"{e}.down_proj.weight", i) for i, e in enumerate(experts)]
        self.w13_weight.weight_loader = self._load_w13
        self.w2_weight.weight_loader = self._load_w2

    def _load_w13(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int) -> None:
        """Copy one expert's ``gate_proj`` (even ``shard_id``) or ``up_proj`` (odd) ``[I, H]``."""
        tensor.check_shape((self.intermediate_size, self.hidden_size))
        rows = slice((shard_id % 2) * self.intermediate_size, (shard_id % 2 + 1) * self.intermediate_size)
        param.data[shard_id // 2, rows].copy_(tensor.load())

    def _load_w2(self, param: nn.Parameter, tensor: LazyTensor, shard_id: int) -> None:
        """Copy one expert's ``down_proj`` ``[H, I]``."""
        tensor.check_shape((self.hidden_size, self.intermediate_size))
        param.data[shard_id].copy_(tensor.load())

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        (out,) = opaque_call(self, (hidden, weights, expert_ids))   # routing is data-dependent: never traced
        return out

    def opaque_fake(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.empty_like(hidden),)

    def opaque_forward(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._experts(hidden, weights, expert_ids),)

    def _experts(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        # sync-free where a graph is captured: under the guard that captures and their CPU stand-in
        # run (the torch references are never captured on CUDA: they read back elsewhere too)
        graph_safe = guarded()
        if self.w13_weight.dtype == torch.float8_e4m3fn:   # kept in FP8 on GPUs (workers/fp8.py)
            return fused_moe(hidden, self.w13_weight, self.w2_weight, weights, expert_ids - self.first,
                             self.w13_weight_scale_inv, self.w2_weight_scale_inv, self.block_size, graph_safe)
        return fused_moe(hidden, self.w13_weight, self.w2_weight, weights, expert_ids - self.first,
                         graph_safe=graph_safe)


class DeepseekMoE(nn.Module):
    """Routed experts held by this rank plus its slice of the shared experts; one all-reduce.

    Args:
        config: HF config (``n_routed_experts``, ``moe_intermediate_size``, ``n_shared_experts``...).
        expert_range: ``(first_expert, num_local_experts)`` this rank holds.
        shared_range: ``(start, size)`` of this rank's slice of the shared experts' intermediate dim
            (``moe_intermediate_size * n_shared_experts``).

        exchange: None (plain TP: one all-reduce over the TP group), or with data-parallel
            attention ``"allgather"`` / ``"alltoall"``: how tokens reach the experts of other
            attention groups (``workers/models/moe_exchange.py``).

    Modules match the checkpoint: ``gate.*`` (router), ``experts.*`` (:class:`FusedExperts`, read
    from the per-expert ``experts.{id}.*_proj`` tensors), ``shared_experts.*``.
    Shapes: ``[T, hidden] -> [T, hidden]`` (all-reduced).
    """

    def __init__(self, config, expert_range: tuple[int, int], shared_range: tuple[int, int] | None,
                 dtype: torch.dtype, exchange: str | None = None) -> None:
        super().__init__()
        assert exchange in (None, "allgather", "alltoall"), f"unknown MoE exchange {exchange!r}"
        self.exchange = exchange
        self.gate = TopkRouter(config)
        self.experts = FusedExperts(config.hidden_size, config.moe_intermediate_size, expert_range, dtype)
        self.shared_experts = None
        if shared_range is not None:
            self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                           shared_range, reduce_output=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            from shardserve.workers.forward_context import get_attention_metadata

            return self.exchange_forward(hidden, get_attention_metadata().dp_token_counts)
        weights, expert_ids = self.gate(hidden)
        out = self.experts(hidden, weights, expert_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return tp_all_reduce(out)

    def exchange_forward(self, hidden: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
        """Data-parallel attention: this group's ``[T_g, H]`` through the experts of every rank.
        ``counts``: tokens of each attention group this step (None: every group has ``T_g``, as
        in the memory-profiling step every rank runs alike)."""
        from shardserve.workers.distributed import get_expert_group, get_tp_group
        from shardserve.workers.models import moe_exchange

        if counts is None:
            counts = [hidden.shape[0]] * (get_expert_group().tp_size // get_tp_group().tp_size)
        exchange = moe_exchange.allgather_moe if self.exchange == "allgather" else moe_exchange.alltoall_moe
        return exchange(self, hidden, counts)
