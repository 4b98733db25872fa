"""In-place recovery of a replica's shard workers and MTP draft worker.

vLLM is fail-stop: one dead tensor-parallel worker ends the engine, and the way back is a new
process that reloads every rank's weights (measured here: Ray Serve replaces a TP=2 SmolLM2
replica in 35.5 s). Here the coordinator, whose process survives, repairs its workers instead:

1. every in-flight request has already ended with an error (``EngineCore.fail_all``) and the
   replica reports itself unhealthy, so nothing that used the lost caches lives on;
2. the ranks that died (or that do not answer: stuck in a collective with the dead peer) get new
   actors in their own placement-group bundles and load their own slices; the surviving ranks keep
   their weights in memory and only zero their caches and forget their requests; every rank
   joins a new communicator; a dead draft worker is replaced the same way (a live one is reset);
3. if a replacement loaded other bytes than the rank it replaces (the files changed on disk since
   start-up), the surviving ranks are brought to the same files by a weight swap, so no replica
   ever mixes two checkpoints;
4. the coordinator drops its prefix cache and reports healthy again.

If a replacement cannot be placed (its node is gone and Ray has not rescheduled the bundle) or
loaded within the recovery timeout (``--recovery-timeout``, default 300 s), recovery gives up and
the replica reports itself failed: Serve's health check then replaces the whole replica. The death
of the coordinator itself is Serve's business too (it is the Serve replica actor).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shardserve.cluster.replica.weight_swap import swap_weights
from shardserve.cluster.replica.worker_group import RemoteDrafter, WorkerDiedError, WorkerGroup

logger = logging.getLogger(__name__)

DEFAULT_RECOVERY_TIMEOUT_S = 300.0
PROBE_TIMEOUT_S = 10.0     # a rank that does not answer a status call in this time is replaced


@dataclass(slots=True)
class RepairReport:
    """What :func:`repair_replica` did."""

    dead_ranks: list[int] = field(default_factory=list)   # shard ranks that got new actors
    draft_restarted: bool = False                         # the draft worker got a new actor
    seconds: float = 0.0                                  # wall time of the repair
    files_changed: bool = False                           # survivors were swapped to the files on disk

    @property
    def restarted(self) -> int:
        """Actors started (counted in ``shardserve_worker_restarts_total``)."""
        return len(self.dead_ranks) + int(self.draft_restarted)


def repair_replica(group: WorkerGroup, drafter: RemoteDrafter | None, timeout_s: float) -> RepairReport:
    """Repair ``group`` and ``drafter`` in place (blocking; NOTE: no step may run meanwhile).

    Raises:
        TimeoutError: a replacement was not placed and loaded within ``timeout_s``.
        WorkerDiedError: a rank failed during the repair.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    probe_s = min(PROBE_TIMEOUT_S, timeout_s)
    report = RepairReport(dead_ranks=group.dead_ranks(probe_s))
    draft_dead = drafter is not None and drafter.is_dead(probe_s)
    before = {rank: group.rank_info[rank]["fingerprint"] for rank in report.dead_ranks}
    draft_before = drafter.info["fingerprint"] if drafter is not None else None
    logger.warning("repairing in place: replacing shard rank(s) %s%s; the other ranks keep their weights",
                   report.dead_ranks, " and the draft worker" if draft_dead else "")
    infos = group.repair(report.dead_ranks, max(0.1, deadline - time.monotonic()))
    if drafter is not None:
        report.draft_restarted = drafter.repair(draft_dead, max(0.1, deadline - time.monotonic()))
        if report.draft_restarted or 0 in report.dead_ranks:   # a new process on either side: new buffers
            group.link_draft(fresh=True)
    report.files_changed = (any(info["fingerprint"] != before[rank] for rank, info in zip(report.dead_ranks, infos))
                            or (report.draft_restarted and drafter.info["fingerprint"] != draft_before))
    if report.files_changed:
        logger.warning("a replacement loaded other bytes than its predecessor (the files at %s changed on disk): "
                       "swapping the other ranks to them too", group.files.path)
        swap_weights([group] + ([drafter] if drafter is not None else []), group.files)
    report.seconds = time.monotonic() - started
    return report


def probe_workers(group: WorkerGroup, drafter: RemoteDrafter | None, timeout_s: float = 30.0) -> list[dict]:
    """Ask every shard worker and the draft worker for its ``status`` (liveness check).

    Returns:
        one dict per worker: ``pid``, ``weight_loads``, ``fingerprint`` as the process reports them,
        plus ``role`` (``shard`` / ``draft``), ``rank`` and ``bundle_index``.

    Raises:
        WorkerDiedError: a worker is dead or did not answer within ``timeout_s``.
    """
    import ray

    actors = list(group.workers) + ([drafter.actor] if drafter is not None else [])
    try:
        answers = ray.get([actor.status.remote() for actor in actors], timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - dead actor, or no answer at all
        raise WorkerDiedError(f"a worker failed its liveness check: {type(exc).__name__}") from exc
    roles = [("shard", rank, group.bundle_index(rank)) for rank in range(len(group.workers))]
    if drafter is not None:
        roles.append(("draft", 0, drafter.placement[1]))
    return [dict(answer, role=role, rank=rank, bundle_index=bundle)
            for answer, (role, rank, bundle) in zip(answers, roles)]
