"""MoE token exchange between attention groups (data-parallel attention, issue 29).

With ``--enable-dp-attention`` the replica's N ranks form D attention groups of G = N / D ranks
(``workers/distributed.py: attention_group_layout``). Each group runs attention, the dense MLPs, the
shared experts and the LM head over its *own* requests as a plain G-way TP group; only the routed
experts are split over all N ranks (expert parallel, whole experts). So in a MoE layer a group's
tokens must reach the ranks holding their experts, and the results must come back:

``allgather`` (the baseline; SGLang's DP-attention gather/scatter):
    1. all-gather every group's hidden states ``[T_g, H]`` over the N ranks, padded to
       ``max_g T_g`` rows (the counts come from the step's plans on the host: no device read-back);
    2. every rank routes all ``sum_g T_g`` tokens (the router is replicated and every rank sees the
       same rows, so the choice agrees everywhere) and runs its own experts over them;
    3. reduce-scatter (sum) a ``[N, max_g T_g, H]`` buffer whose part r holds this rank's expert
       output for the tokens of rank r's group (plus, for the ranks of its own group, its slice of
       the shared experts): every rank gets its group's finished MoE output in one collective.

``alltoall`` (DeepEP's dispatch/combine idea): see :func:`alltoall_moe`.

A group with nothing to do in a step (an empty plan) still joins every exchange with zero rows,
layer by layer (:meth:`workers.models.deepseek_v32.DeepseekModel.idle_forward`), so the collectives
stay in step.

On CUDA neither exchange is captured in a decode graph: the token counts change every step (and
``alltoall`` reads its per-destination counts back to the host), so under data-parallel attention
decode runs eagerly (``ModelRunner.graph_backend`` is None) and the forward is not
``torch.compile``'d. With G > 1, ``allgather`` moves each group's rows G times (every rank of the
group sends them; only the first copy is used) and ``alltoall`` shares a group's tokens out among
its ranks instead. Collectives: ``all_gather_equal`` / ``reduce_scatter`` / ``all_to_all`` of
:class:`workers.distributed.TensorParallelGroup` (shm and gloo on CPU, NCCL on GPU: ``ncclReduceScatter``
and grouped ``ncclSend`` / ``ncclRecv``, untested here for want of a GPU).
"""

from __future__ import annotations

import torch

from shardserve.workers.distributed import get_expert_group, get_tp_group


def group_offsets(counts: list[int]) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: where each group's tokens start in the gathered rows."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def allgather_moe(moe, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The MoE layer ``moe`` (:class:`workers.models.moe.DeepseekMoE`) over this group's tokens,
    exchanging them with the other groups by all-gather + reduce-scatter (module docstring).

    Args:
        moe: the layer (``gate``, ``experts`` over this rank's global expert range, optional
            ``shared_experts`` split over the attention group).
        hidden: ``[T_g, H]`` this group's post-attention normed hidden states (the same on each of
            the group's ranks).
        counts: ``[D]`` tokens of every group this step (host ints; ``counts[group] == T_g``).

    Returns:
        ``[T_g, H]`` the MoE output (routed + shared), already summed over every rank.
    """
    tp, ep = get_tp_group(), get_expert_group()
    size = tp.tp_size
    mine, num_groups = ep.tp_rank // size, ep.tp_size // size
    assert len(counts) == num_groups and counts[mine] == hidden.shape[0], \
        f"group {mine} has {hidden.shape[0]} tokens, step counts {counts}"
    width, rows = hidden.shape[1], max(counts)
    padded = hidden.new_zeros(rows, width)
    padded[:hidden.shape[0]] = hidden
    parts = ep.all_gather_equal(padded)                  # N x [rows, H]; a group's G ranks send the same rows
    tokens = torch.cat([parts[g * size][:counts[g]] for g in range(num_groups)])   # [sum T, H]
    weights, expert_ids = moe.gate(tokens)
    routed = moe.experts(tokens, weights, expert_ids)    # [sum T, H] this rank's experts only
    offsets = group_offsets(counts)
    buffer = hidden.new_zeros(ep.tp_size, rows, width)   # part r: rows of rank r's group
    for g in range(num_groups):
        buffer[g * size:(g + 1) * size, :counts[g]] = routed[offsets[g]:offsets[g + 1]]
    if moe.shared_experts is not None:                   # this rank's slice of its own group's shared experts
        buffer[mine * size:(mine + 1) * size, :hidden.shape[0]] += moe.shared_experts(hidden)
    return ep.reduce_scatter(buffer)[:hidden.shape[0]]


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
       contributions are summed; the shared experts' slice is added and, for G > 1, the group
       all-reduces (its ranks hold disjoint token shares and partial shared sums).

    Args / returns: as :func:`allgather_moe` (``counts`` only checks this group's size: the
    exchange sizes come from the routing).

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
    result.index_add_(0, rows[token], back.to(hidden.dtype))
    if moe.shared_experts is not None:
        result += moe.shared_experts(hidden)
    return tp.all_reduce(result) if size > 1 else result
