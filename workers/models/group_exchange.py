"""Layers split over every rank of a replica under data-parallel attention (issue 29).

With ``--enable-dp-attention`` the replica's N ranks form D attention groups of G = N / D
consecutive ranks (``workers/distributed.py: attention_group_layout``). Each group runs MLA and the
DSA indexer over its *own* tokens, split over its G ranks as plain TP. Everything else is split over
all N ranks (the expert group), as SGLang does under DP attention (``moe_dense_tp_size`` = the full
TP, the vocabulary over all ranks unless ``--enable-dp-lm-head``): the routed experts (whole
experts, ``workers/models/moe_exchange.py``), and here

- the token embedding (vocab parallel over N): :class:`GroupVocabEmbedding`,
- the dense MLP layers and the shared experts (intermediate dim over N): :class:`GroupGatedMLP`,
- the LM head (vocab parallel over N, the rows that sample): :class:`GroupLMHead`.

Each of them runs on the step's tokens of *every* group: :func:`gather_groups` all-gathers each
group's rows over the N ranks (padded to the largest group's count; the counts are host ints
from the step's plans, so nothing is read back from the device), the rank applies its slice to all
of them, and :func:`scatter_groups` reduce-scatters a ``[N, rows, H]`` buffer whose part r holds
this rank's partial result for rank r's group: every rank ends with its own group's complete rows.
So a rank holds 1/N of these weights instead of 1/G (at G = 1, a whole copy), and an attention
group's step budget is the replica's divided by D (SGLang divides ``chunked_prefill_size`` by the
DP size), so the gathered rows are the replica's step budget.

Counts: ``AttentionMetadata.dp_token_counts`` (tokens of each group) and ``dp_logit_counts`` (rows
that need logits in each group), set by ``ModelRunner`` for a ``DataParallelPlan``; None (the
memory-profiling step, which every rank runs alike) means every group has this rank's count. A
group without tokens joins each exchange with zero rows (``DeepseekModel.idle_forward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.workers.distributed import get_expert_group, get_tp_group
from shardserve.workers.forward_context import current_metadata
from shardserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.workers.models.moe import GatedMLP


def group_offsets(counts: list[int]) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: where each group's rows start in the gathered rows."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def own_group() -> tuple[int, int, int]:
    """``(this rank's group index, G ranks per group, D groups)`` from the installed groups."""
    size, experts = get_tp_group().tp_size, get_expert_group()
    return experts.tp_rank // size, size, experts.tp_size // size


def step_counts(rows: int, name: str = "dp_token_counts") -> list[int]:
    """The step's per-group counts (``name`` of the forward context's metadata), or ``[rows] * D``
    outside a data-parallel step (profiling: every group runs this rank's shape)."""
    meta = current_metadata()
    counts = None if meta is None else getattr(meta, name)
    return [rows] * own_group()[2] if counts is None else counts


def gather_groups(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every group's rows on every rank of the replica.

    Args:
        rows: ``[counts[g], ...]`` this group's rows (the same on each of its G ranks), any dtype
            the backend moves (token ids below 2**24 travel exactly through the shm float slots).
        counts: ``[D]`` rows of each group this step (host ints, the same on every rank).

    Returns:
        ``[sum(counts), ...]``: group 0's rows, then group 1's, ...
    """
    mine, size, num_groups = own_group()
    assert len(counts) == num_groups and counts[mine] == rows.shape[0], \
        f"group {mine} has {rows.shape[0]} rows, step counts {counts}"
    padded = rows.new_zeros(max(counts), *rows.shape[1:])
    padded[:rows.shape[0]] = rows
    parts = get_expert_group().all_gather_equal(padded)   # N x [max, ...]; a group's G ranks send the same rows
    return torch.cat([parts[g * size][:counts[g]] for g in range(num_groups)])


def scatter_groups(partial: torch.Tensor, counts: list[int], own: torch.Tensor | None = None) -> torch.Tensor:
    """Sum every rank's partial results and hand each group its own rows (one reduce-scatter).

    Args:
        partial: ``[sum(counts), H]`` this rank's partial result for every group's rows (in
            :func:`gather_groups` order).
        counts: ``[D]`` rows of each group.
        own: optional ``[counts[g], H]`` partial result for this rank's own group only (added to
            the parts of its G ranks: e.g. the routed experts of the alltoall exchange).

    Returns:
        ``[counts[g], H]`` this group's rows summed over all N ranks, ``partial``'s dtype.
    """
    mine, size, num_groups = own_group()
    experts, offsets = get_expert_group(), group_offsets(counts)
    buffer = partial.new_zeros(experts.tp_size, max(counts), partial.shape[1])   # part r: rank r's group
    for g in range(num_groups):
        buffer[g * size:(g + 1) * size, :counts[g]] = partial[offsets[g]:offsets[g + 1]]
    if own is not None:
        buffer[mine * size:(mine + 1) * size, :counts[mine]] += own
    return experts.reduce_scatter(buffer)[:counts[mine]]


class GroupVocabEmbedding(VocabParallelEmbedding):
    """Token embedding with the vocabulary split over all N ranks; each group's tokens are looked
    up by every rank (module docstring). ``input_ids [T_g] int64 -> [T_g, hidden_size]``."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.exchange(input_ids, step_counts(input_ids.shape[0]))

    def exchange(self, input_ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`forward` with explicit per-group token ``counts`` (an idle group: ``T_g = 0``)."""
        ids = gather_groups(input_ids, counts)                           # [sum T]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size_local)
        out = self._lookup(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)
        return scatter_groups(out, counts)


class GroupGatedMLP(GatedMLP):
    """A dense SwiGLU MLP (a dense layer, or the shared experts) with its intermediate dim split
    over all N ranks, run on every group's tokens (build it with ``reduce_output=False``).
    ``[T_g, hidden] -> [T_g, hidden]`` (summed over the replica)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.exchange(hidden, step_counts(hidden.shape[0]))

    def exchange(self, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`forward` with explicit per-group token ``counts``."""
        return scatter_groups(super().forward(gather_groups(hidden, counts)), counts)


class GroupLMHead(ParallelLMHead):
    """The LM head with the vocabulary split over all N ranks (``sizes``: every rank's slice).
    The rows that sample in every group are gathered, each rank computes its vocab slice of their
    logits, and the slices are all-gathered (as plain TP's head does): each rank of a group gets
    full-vocab float32 logits ``[R_g, vocab]`` for its own rows ``hidden [R_g, hidden_size]``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.exchange(hidden, step_counts(hidden.shape[0], "dp_logit_counts"))

    def exchange(self, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`forward` with explicit per-group row ``counts`` (an idle group: ``R_g = 0``)."""
        mine = own_group()[0]
        if not sum(counts):   # no group samples this step (every rank sees the same counts)
            return torch.empty(0, self.vocab_size, device=hidden.device)
        rows = gather_groups(hidden, counts)                                                     # [sum R, H]
        logits = (F.linear(rows, self.weight) if self.packed is None else self.packed.matmul(rows)).float()
        logits = get_expert_group().all_gather(logits, self.sizes)                                # [sum R, V]
        offsets = group_offsets(counts)
        return logits[offsets[mine]:offsets[mine + 1]]
