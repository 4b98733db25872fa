"""``ModelReplica``'s Serve request router (:mod:`cluster.frontend.replica_directory` explains the
role). Serve pickles this module by value into every process holding a handle to the deployment,
so it keeps no state of its own: the replica lists go to the directory module, imported when they
arrive (the real module of that process, not a pickled copy)."""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class ReplicaDirectoryRouter(RequestRouter):
    """Publishes every replica list Serve pushes (with each replica's routing stats) and routes
    calls that name a replica (``target=<replica id>``) to that replica; other calls go to any."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        from shardserve.cluster.frontend.replica_directory import ReplicaEntry, publish

        super().update_replicas(replicas)
        entries = [ReplicaEntry(r.replica_id.unique_id, dict(r.routing_stats or {})) for r in replicas]
        publish((self._deployment_id.app_name, self._deployment_id.name), entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get("target") if pending_request is not None else None
        if target is None:
            return [candidate_replicas]
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        if not chosen and pending_request is not None:
            pending_request.routing_context.should_backoff = True   # gone (or not yet listed): wait, do not spin
        return [chosen]
