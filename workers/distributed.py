"""The tensor-parallel group: this rank's place in it and its collectives.

NOTE: one of the two module-level globals of the workers (the other is the forward context in
``workers/forward_context.py``). A process has one TP group, set once at worker start-up by
:func:`set_tp_group`; layers read it through :func:`get_tp_group`. At ``tp_size == 1`` every
collective is the identity and costs nothing. With data-parallel attention (issue 29) the global
is a pair: the TP group is the rank's *attention group* (the G ranks that split attention, dense
layers, shared experts and the LM head among themselves) and :func:`get_expert_group` is the group
of all N ranks of the replica, over which the routed experts are split; without it the expert
group is the TP group itself.

Backends (pick with :func:`collective_kind`): ``shm`` (shared-memory all-reduce for CPU ranks on
one node, ``workers/comm_cpu.py``), ``gloo`` (torch.distributed, CPU ranks on several nodes), and
``nccl`` (NCCL through CuPy on GPUs, ``workers/comm_nccl.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TensorParallelGroup:
    """Rank ``tp_rank`` of ``tp_size``. Subclasses implement :meth:`all_reduce` and
    :meth:`_all_gather_equal`; the uneven all-gather is built on the latter here, once.

    The base class is the single-rank group: collectives return their input.
    ``collective_s`` accumulates the wall time spent in collectives (seconds; the worker reports
    it per step).
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1) -> None:
        assert 0 <= tp_rank < tp_size, f"tp_rank={tp_rank} outside tp_size={tp_size}"
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.collective_s = 0.0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("all_reduce", "_all_gather_equal", "_reduce_scatter_equal", "_all_to_all"):
            if name in cls.__dict__:
                setattr(cls, name, _timed(cls.__dict__[name]))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks; every rank gets the same (bitwise) result."""
        assert self.tp_size == 1, "single-rank group cannot all-reduce across ranks"
        return tensor

    def _all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (all of one shape), in rank order."""
        assert self.tp_size == 1, "single-rank group cannot all-gather across ranks"
        return [tensor]

    def _reduce_scatter_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor [tp_size, ...]`` summed over ranks; this rank keeps part ``tp_rank`` ``[...]``."""
        assert self.tp_size == 1, "single-rank group cannot reduce-scatter across ranks"
        return tensor[0]

    def all_gather_equal(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (one shape on every rank), in rank order: ``tp_size`` tensors."""
        return [tensor] if self.tp_size == 1 else self._all_gather_equal(tensor.contiguous())

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor [tp_size, *shape]`` over ranks and keep this rank's part ``[*shape]``
        (part r of the sum goes to rank r; MPI's ``MPI_Reduce_scatter_block``). Same dtype out."""
        assert tensor.shape[0] == self.tp_size, f"reduce_scatter of {tuple(tensor.shape)} over {self.tp_size} ranks"
        return tensor[0] if self.tp_size == 1 else self._reduce_scatter_equal(tensor.contiguous())

    def all_to_all(self, send: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Personalized exchange of rows: ``send [sum_d counts[me][d], ...]`` holds the rows for rank
        0, then rank 1, ... (``counts[s][d]``: rows rank s sends rank d, known on every rank).
        Returns ``[sum_s counts[s][me], ...]``: the rows every rank sent this one, in rank order
        (MPI's ``MPI_Alltoallv``)."""
        assert send.shape[0] == sum(counts[self.tp_rank]), \
            f"rank {self.tp_rank} sends {send.shape[0]} rows, counts say {counts[self.tp_rank]}"
        return send if self.tp_size == 1 else self._all_to_all(send.contiguous(), counts)

    def _all_to_all(self, send: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Generic all-to-all through the equal all-gather (every rank receives every row; backends
        with a real exchange override it)."""
        width = max(sum(row) for row in counts)
        padded = send.new_zeros(width, *send.shape[1:])
        padded[:send.shape[0]] = send
        parts = self._all_gather_equal(padded)
        me = self.tp_rank
        return torch.cat([part[sum(row[:me]):sum(row[:me + 1])] for part, row in zip(parts, counts)])

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along the last dim; rank r contributes ``sizes[r]``
        columns (uneven splits allowed). Returns ``[..., sum(sizes)]`` on every rank.

        Ranks pad to ``max(sizes)`` so the backend moves equal shapes, then cut the padding.
        """
        assert len(sizes) == self.tp_size and tensor.shape[-1] == sizes[self.tp_rank], \
            f"rank {self.tp_rank} has {tensor.shape[-1]} columns, sizes={sizes}"
        if self.tp_size == 1:
            return tensor
        width = max(sizes)
        padded = F.pad(tensor, (0, width - tensor.shape[-1])).contiguous()
        parts = self._all_gather_equal(padded)
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)

    def close(self) -> None:
        """Release backend resources (idempotent)."""


def _timed(method):
    """Wrap a collective so its wall time adds to ``self.collective_s``."""
    import functools
    import time

    @functools.wraps(method)
    def wrapper(self, *args):
        start = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.collective_s += time.perf_counter() - start

    return wrapper


_TP_GROUP: TensorParallelGroup = TensorParallelGroup()
_EXPERT_GROUP: TensorParallelGroup | None = None   # None: the TP group (plain TP)


def set_tp_group(group: TensorParallelGroup, expert_group: TensorParallelGroup | None = None) -> None:
    """Install this process's TP group (once, before the model is built) and, with data-parallel
    attention, the group of all the replica's ranks that splits the routed experts."""
    global _TP_GROUP, _EXPERT_GROUP
    _TP_GROUP, _EXPERT_GROUP = group, expert_group


def get_tp_group() -> TensorParallelGroup:
    """This process's TP group (the single-rank group unless :func:`set_tp_group` ran); with
    data-parallel attention, its attention group."""
    return _TP_GROUP


def get_expert_group() -> TensorParallelGroup:
    """The group the routed experts are split over: every rank of the replica. The TP group itself
    unless data-parallel attention installed a larger one."""
    return _TP_GROUP if _EXPERT_GROUP is None else _EXPERT_GROUP


def attention_group_layout(rank: int, tp_size: int, attention_dp_size: int) -> tuple[int, int, int]:
    """``(group index, rank inside the group, group size G)`` of replica rank ``rank`` when its
    ``tp_size`` ranks form ``attention_dp_size`` attention groups of ``G = tp_size / attention_dp_size``
    consecutive ranks (SGLang's ``--enable-dp-attention`` layout; issue 29).

    Raises:
        ValueError: ``attention_dp_size`` does not divide ``tp_size``.
    """
    if attention_dp_size < 1 or tp_size % attention_dp_size:
        raise ValueError(f"--attention-dp-size {attention_dp_size} must divide the {tp_size} ranks of the replica")
    size = tp_size // attention_dp_size
    return rank // size, rank % size, size


def collective_kind(device: str, same_node: bool, requested: str | None = None) -> str:
    """The backend for a group: ``nccl`` on CUDA; on CPU ``shm`` when every rank shares a node,
    else ``gloo``. ``requested`` (``shm``/``gloo``) overrides on CPU.

    Raises:
        ValueError: an unknown or impossible request (``shm`` across nodes).
    """
    if device.startswith("cuda"):
        return "nccl"
    if requested not in (None, "shm", "gloo"):
        raise ValueError(f"unknown CPU collective {requested!r}: expected 'shm' or 'gloo'")
    if requested == "shm" and not same_node:
        raise ValueError("the shared-memory all-reduce needs every rank on one node; use 'gloo'")
    return requested or ("shm" if same_node else "gloo")
