"""Hot-swap of changed weights for a whole replica: validate, stage on every rank, commit.

The rank side (digests of each rank's own slices, staging, in-place commit) is
:mod:`workers.weight_reload`. Here: the new checkpoint is checked against the served one first
(:class:`workers.checkpoint_compat.CheckpointManifest`), then every weight holder (the shard worker
group, the MTP draft worker) stages; only when all of them staged does any of them commit, so a
refused or failed reload leaves the old weights serving byte for byte. The coordinator pauses
admission around it (``drain`` waits for running requests, ``abort`` ends them) and drops the
prefix cache afterwards (see :meth:`cluster.replica.coordinator.Coordinator.reload_weights`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from shardserve.workers.checkpoint import CheckpointError
from shardserve.workers.checkpoint_compat import CheckpointManifest
from shardserve.workers.model_source import ModelFiles, resolve_model
from shardserve.workers.weight_reload import ReloadableRank

RELOAD_MODES = ("drain", "abort")


class InvalidCheckpoint(ValueError):
    """The new checkpoint cannot replace the served weights (the message names the first bad
    tensor, configuration field or file). Nothing was changed."""


class WeightHolder(Protocol):
    """Something that holds weights on one or more ranks (the worker group, the draft worker)."""

    def stage_reload(self, files: ModelFiles) -> list[dict]: ...

    def commit_reload(self, files: ModelFiles) -> None: ...

    def discard_reload(self) -> None: ...


@dataclass(slots=True)
class ReloadResult:
    """The answer of a reload (HTTP ``/admin/reload_weights`` and gRPC ``ReloadWeights``)."""

    changed_tensors: int        # checkpoint tensors whose bytes changed in some rank's slice
    unchanged_tensors: int      # checkpoint tensors read and found equal on every rank
    seconds: float              # wall time from the request to serving again (validation, drain, swap)
    weights_version: int        # 1 at start-up, +1 per reload that changed a tensor
    aborted_requests: int = 0   # requests ended by ``mode="abort"``

    def as_dict(self) -> dict:
        return asdict(self)


def check_mode(mode: str | None) -> str:
    """``mode`` or the default (``drain``).

    Raises:
        ValueError: an unknown mode.
    """
    mode = mode or "drain"
    if mode not in RELOAD_MODES:
        raise ValueError(f"mode must be one of {list(RELOAD_MODES)}, got {mode!r}")
    return mode


def check_replacement(served: CheckpointManifest, model: str) -> tuple[ModelFiles, CheckpointManifest]:
    """Resolve ``model`` and check it can replace ``served`` in place (reads headers only).

    Returns:
        ``(files, their manifest)``.

    Raises:
        InvalidCheckpoint: missing path, other architecture / vocabulary / configuration, a missing
            or misshapen tensor, a truncated or unreadable file.
    """
    try:
        files = resolve_model(model)
        manifest = CheckpointManifest.read(files)
        served.check_replacement(manifest)
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as exc:
        raise InvalidCheckpoint(str(exc)) from exc
    return files, manifest


def swap_weights(holders: list[WeightHolder], files: ModelFiles) -> tuple[set[str], set[str]]:
    """Stage ``files`` on every holder, then commit on every holder (NOTE: no step may run).

    Returns:
        ``(changed tensor names, unchanged tensor names)`` over all ranks.

    Raises:
        InvalidCheckpoint: a rank could not read a tensor; every holder discarded what it staged.
        WorkerDiedError: a rank died (the caller repairs the replica).
    """
    answers, staged = [], []
    try:
        for holder in holders:
            staged.append(holder)
            answers += holder.stage_reload(files)
    except BaseException as exc:
        for holder in staged:
            holder.discard_reload()
        if isinstance(exc, CheckpointError):   # from a Ray rank: a RayTaskError that is also one
            raise InvalidCheckpoint(str(getattr(exc, "cause", None) or exc)) from exc
        raise
    for holder in holders:
        holder.commit_reload(files)
    changed = set().union(*(answer["changed"] for answer in answers))
    read = set().union(*(answer["read"] for answer in answers))
    return changed, read - changed


class LocalHolder:
    """A :class:`WeightHolder` over weight owners in this process (the single-process engine).

    Args:
        owners: objects with ``model``, ``hf_config``, ``requests`` and ``weight_record`` (a
            :class:`workers.model_runner.ModelRunner`, a :class:`workers.draft_worker.DraftWorker`).
    """

    def __init__(self, owners: list) -> None:
        self.ranks = [_LocalRank(owner) for owner in owners]

    def stage_reload(self, files: ModelFiles) -> list[dict]:
        return [rank.stage_reload(files) for rank in self.ranks]

    def commit_reload(self, files: ModelFiles) -> None:
        for rank in self.ranks:
            rank.commit_reload()

    def discard_reload(self) -> None:
        for rank in self.ranks:
            rank.discard_reload()


class _LocalRank(ReloadableRank):
    def __init__(self, owner) -> None:
        self._owner = owner

    def _weights(self):
        return self._owner
