"""MoE token exchange between attention groups (data-parallel attention, issue 29).

With ``--enable-dp-attention`` the replica's N ranks form D attention groups of G = N / D ranks
(``workers/distributed.py: attention_group_layout``). Each group runs attention (MLA + the DSA
indexer) over its *own* requests as a plain G-way TP group; the routed experts are split over all N
ranks (expert parallel, whole experts), and so are the shared experts, the dense MLPs, the
embedding and the LM head (intermediate dim / vocabulary over N: ``workers/models/group_exchange.py``,
SGLang's layout). So in a MoE layer a group's tokens must reach the ranks holding their experts,
and the results must come back:

``allgather`` (the baseline; SGLang's DP-attention gather/scatter):
    1. all-gather every group's hidden states ``[T_g, H]`` over the N ranks, padded to
       ``max_g T_g`` rows (the counts come from the step's plans on the host: no device read-back);
    2. every rank routes all ``sum_g T_g`` tokens (the router is replicated and every rank sees the
       same rows, so the choice agrees everywhere), runs its own experts and its 1/N slice of the
       shared experts over them;
    3. reduce-scatter (sum) a ``[N, max_g T_g, H]`` buffer whose part r holds this rank's output
       for the tokens of rank r's group: every rank gets its group's finished MoE output in one
       collective.

``alltoall`` (DeepEP's dispatch/combine idea): see :func:`alltoall_moe`.

A group with nothing to do in a step (an empty plan) still joins every exchange with zero rows,
layer by layer (:meth:`workers.models.deepseek_v32.DeepseekModel.idle_forward`), so the collectives
stay in step.

On CUDA neither exchange is captured in a decode graph: the token counts change every step (and
``alltoall`` reads its per-destination counts back to the host), so under data-parallel attention
decode runs eagerly (``ModelRunner.graph_backend`` is None) and the forward is not
``torch.compile``'d. With G > 1, ``allgather`` moves each group's rows G times (every rank of the
group sends them; only the first copy is used) and ``alltoall`` shares a group's tokens out among
its ranks instead (its shared experts still see every group's tokens, as a dense layer does).
Collectives: ``all_gather_equal`` / ``reduce_scatter`` / ``all_to_all`` of
:class:`workers.distributed.TensorParallelGroup` (shm and gloo on CPU, NCCL on GPU:
``ncclReduceScatter`` and grouped ``ncclSend`` / ``ncclRecv``, untested here for want of a GPU).
"""

from __future__ import annotations

import torch

from shardserve.workers.distributed import get_expert_group, get_tp_group
from shardserve.workers.models.group_exchange import gather_groups, scatter_groups


def allgather_moe(moe, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The MoE layer ``moe`` (:class:`workers.models.moe.DeepseekMoE`) over this group's tokens,
    exchanging them with the other groups by all-gather + reduce-scatter (module docstring).

    Args:
        moe: the layer (``gate``, ``experts`` over this rank's global expert range, optional
            ``shared_experts`` with their intermediate dim split over all N ranks).
        hidden: ``[T_g, H]`` this group's post-attention normed hidden states (the same on each of
            the group's ranks).
        counts: ``[D]`` tokens of every group this step (host ints; ``counts[group] == T_g``).

    Returns:
        ``[T_g, H]`` the MoE output (routed + shared), already summed over every rank.
    """
    tokens = gather_groups(hidden, counts)               # [sum T, H]: every group's tokens
    weights, expert_ids = moe.gate(tokens)
    out = moe.experts(tokens, weights, expert_ids)       # [sum T, H] this rank's experts only
    if moe.shared_experts is not None:                   # this rank's 1/N slice of the shared experts
        out = out + moe.shared_experts(tokens)
    return scatter_groups(out, counts)


def expert_owners(num_experts: int, num_ranks: int, device: torch.device) -> torch.Tensor:
    """``[num_experts]`` int64: the expert-group rank holding each routed expert (the even whole-
    expert split of :func:`workers.partition.split_units`, as the model is built)."""
    from shardserve.workers.partition import split_units

    owners = torch.empty(num_experts, dtype=torch.int64)
    for rank, (start, count) in enumerate(split_units(num_experts, num_ranks)):
        owners[start:start + count] = rank
    return owners.to(device)


def alltoall_moe(moe, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The MoE layer ``moe`` over this group's tokens, each token sent only to the ranks holding
    its chosen experts (DeepEP's dispatch / combine, without its kernels):

    1. the group's tokens are shared out among its G ranks (rank l of the group takes rows
       ``l, l + G, ...``) and each rank routes its share;
    2. dispatch: for every destination rank, the tokens with at least one chosen expert there
       (with their top-k ids and weights); the per-destination row counts are all-gathered first
       (a host read: the receive sizes), then one all-to-all moves the rows;
    3. each rank runs its experts over what it received (weighted by the routing weights; ids of
       other ranks' experts contribute nothing);
    4. combine: the outputs go back the same way (the transposed counts) and each token's
       contributions are summed on the rank that routed the token;
    5. the shared experts (split over all N ranks) run on every group's tokens as a dense layer does
       (:func:`workers.models.group_exchange.gather_groups` / ``scatter_groups``), and that one
       reduce-scatter also sums the G token shares of each group's routed output. Without shared
       experts a group of G > 1 all-reduces its shares instead.

    Args / returns: as :func:`allgather_moe` (the routed exchange's sizes come from the routing;
    ``counts`` sizes the shared experts' exchange).

    NOTE: the counts exchange reads the device (``tolist``), so on CUDA this path cannot be
    captured in a graph; under data-parallel attention decode runs eagerly anyway. Payloads are
    float32 (ids ride along exactly, below 2**24).
    """
    tp, ep = get_tp_group(), get_expert_group()
    size, local, num_ranks = tp.tp_size, tp.tp_rank, ep.tp_size
    num_tokens, width = hidden.shape
    assert counts[ep.tp_rank // size] == num_tokens, f"group has {num_tokens} tokens, step counts {counts}"
    rows = torch.arange(num_tokens, device=hidden.device)[local::size]   # this rank's share (maybe none)
    share = hidden[rows]                                                  # [T_l, H]
    weights, expert_ids = moe.gate(share)                                 # [T_l, k] float32, int64
    owners = getattr(moe, "_owners", None)
    if owners is None or owners.device != hidden.device:
        owners = moe._owners = expert_owners(moe.gate.num_experts, num_ranks, hidden.device)
    goes_to = torch.zeros(share.shape[0], num_ranks, dtype=torch.bool, device=hidden.device)
    goes_to.scatter_(1, owners[expert_ids], True)                         # token -> destinations
    dest, token = goes_to.t().nonzero(as_tuple=True)                      # sorted by destination, then token
    sent = torch.bincount(dest, minlength=num_ranks).float()
    matrix = [[int(c) for c in row.tolist()] for row in ep.all_gather_equal(sent)]   # [N][N] host ints
    top_k = expert_ids.shape[1]
    payload = torch.cat([share[token].float(), weights[token], expert_ids[token].float()], dim=1)   # [S, H + 2k]
    received = ep.all_to_all(payload, matrix)                             # [R, H + 2k]
    out = received.new_zeros(0, width)                                    # [R, H] this rank's experts
    if received.shape[0]:
        out = moe.experts(received[:, :width].to(hidden.dtype), received[:, width:width + top_k],
                          received[:, width + top_k:].long())
    back = ep.all_to_all(out, [list(col) for col in zip(*matrix)])        # [S, H] in send order
    result = hidden.new_zeros(num_tokens, width)
    result.index_add_(0, rows[token], back.to(hidden.dtype))                # this rank's share's routed sum
    if moe.shared_experts is not None:   # shared experts over N ranks; the group's shares summed in the same call
        return scatter_groups(moe.shared_experts(gather_groups(hidden, counts)), counts, own=result)
    return tp.all_reduce(result) if size > 1 else result
