"""The tensor-parallel group: this rank's place in it and its collectives.

NOTE: one of the two module-level globals of the workers (the other is the forward context in
``workers/forward_context.py``). A process has one TP group, set once at worker start-up by
:func:`set_tp_group`; layers read it through :func:`get_tp_group`. At ``tp_size == 1`` every
collective is the identity and costs nothing.
"""

from __future__ import annotations

import torch


class TensorParallelGroup:
    """Rank ``tp_rank`` of ``tp_size``; subclasses implement the collectives over a backend.

    The base class is the single-rank group: collectives return their input.
    """

    def __init__(self, tp_rank: int = 0, tp_size: int = 1) -> None:
        assert 0 <= tp_rank < tp_size, f"tp_rank={tp_rank} outside tp_size={tp_size}"
        self.tp_rank = tp_rank
        self.tp_size = tp_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks (in place where the backend allows); returns the sum."""
        assert self.tp_size == 1, "single-rank group cannot all-reduce across ranks"
        return tensor

    def all_gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along the last dim; rank r contributes ``sizes[r]``
        columns (uneven splits allowed). Returns ``[..., sum(sizes)]`` on every rank."""
        assert self.tp_size == 1, "single-rank group cannot all-gather across ranks"
        return tensor


_TP_GROUP: TensorParallelGroup = TensorParallelGroup()


def set_tp_group(group: TensorParallelGroup) -> None:
    """Install this process's TP group (once, before the model is built)."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> TensorParallelGroup:
    """This process's TP group (the single-rank group unless :func:`set_tp_group` ran)."""
    return _TP_GROUP
