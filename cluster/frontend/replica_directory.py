"""How the router learns the model replicas from Ray Serve: one ``ModelReplica`` deployment, its
running replicas and their routing stats, through a Serve request router.

Ray Serve keeps, for every deployment, the list of running replicas and what each one's
``record_routing_stats()`` last returned (polled every ``request_routing_stats_period_s``), and
pushes every change to the request router of each handle to the deployment. ``ModelReplica``
declares :class:`cluster.frontend.serve_request_router.ReplicaDirectoryRouter` as its request
router, so the router's handle to the deployment holds one; it hands each replica list to the
listeners of this process (:func:`subscribe`), and routes handle calls that name a replica
(``target=<replica id>``) to that replica alone (``status`` and ``cache_events`` of one replica).

Serve lists a replica only once its constructor returned (its model is loaded) and drops it as
soon as it starts stopping (scale-down, upgrade), so the router never sends new requests to a
replica that is loading or draining. Generation itself does not go through Serve: the router calls
the replica's gRPC address from its routing stats (no Ray object per token).

:class:`ServeReplicas` is what :class:`cluster.frontend.openai_router.RouterCore` reads: the
replicas (id and routing stats) and, per replica, its status (internal token, ModelInfo) and its
prefix-cache event stream. :class:`StaticReplicas` gives the same interface over a fixed list of
status functions (tests, in-process routers).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
REPLICA_DEPLOYMENT = "ModelReplica"


@dataclass(slots=True, frozen=True)
class ReplicaEntry:
    """A running replica as Serve lists it."""

    replica_id: str                              # Serve's unique id of the replica
    stats: dict = field(default_factory=dict)    # its last record_routing_stats() answer ({} before the first)


Listener = Callable[[list[ReplicaEntry]], None]
_lock = threading.Lock()
_listeners: dict[tuple[str, str], list[Listener]] = {}   # (app, deployment) -> callbacks
_latest: dict[tuple[str, str], list[ReplicaEntry]] = {}


def subscribe(app_name: str, deployment: str, listener: Listener) -> Callable[[], None]:
    """Call ``listener(entries)`` with every replica list Serve pushes for ``app_name/deployment``
    (at once with the latest one, if any). It may run on Serve's router thread. Returns the
    function that unsubscribes."""
    key = (app_name, deployment)
    with _lock:
        _listeners.setdefault(key, []).append(listener)
        latest = _latest.get(key)
    if latest is not None:
        listener(latest)

    def unsubscribe() -> None:
        with _lock:
            if listener in _listeners.get(key, []):
                _listeners[key].remove(listener)

    return unsubscribe


def publish(key: tuple[str, str], entries: list[ReplicaEntry]) -> None:
    """Hand ``entries`` (the replicas of deployment ``key = (app, name)``) to its listeners."""
    with _lock:
        _latest[key] = entries
        listeners = list(_listeners.get(key, []))
    for listener in listeners:
        try:
            listener(entries)
        except Exception:  # noqa: BLE001 - one listener's bug must not stop Serve's updates
            logger.exception("replica directory listener failed")


class ServeReplicas:
    """The replicas of ``ModelReplica`` through its deployment handle (inside the router's replica).

    Args:
        handle: DeploymentHandle of the ``ModelReplica`` deployment.
        app_name: the Serve application (the handle's).
    """

    def __init__(self, handle, app_name: str) -> None:
        self.handle, self.app_name = handle, app_name
        self._unsubscribe: Callable[[], None] | None = None

    def watch(self, on_change: Callable[[list[ReplicaEntry]], None]) -> None:
        """Call ``on_change(entries)`` on the running event loop with every replica list."""
        loop = asyncio.get_running_loop()
        self._unsubscribe = subscribe(self.app_name, self.handle.deployment_name,
                                      lambda entries: loop.call_soon_threadsafe(on_change, entries))
        # The handle's request router (and Serve's updates to it) starts with its first call.
        self._first = self.handle.status.remote()

    async def status(self, replica_id: str) -> dict:
        """That replica's ``status()``: state, address, internal token, ModelInfo."""
        return await self.handle.status.remote(target=replica_id)

    async def cache_events(self, replica_id: str) -> AsyncIterator[dict]:
        """That replica's prefix-cache events (:mod:`cluster.replica.cache_events`).

        NOTE: the stream is cancelled on the replica when the reader stops (the router drops the
        replica, or closes): Serve counts an open stream as an ongoing request, and a stopping
        replica waits for its ongoing requests, so a stream left open would hold a scale-down or
        an upgrade for the whole graceful-shutdown timeout.
        """
        stream = self.handle.options(stream=True).cache_events.remote(target=replica_id)
        try:
            async for message in stream:
                yield message
        finally:
            stream.cancel()

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        first = getattr(self, "_first", None)
        if first is not None:
            first.cancel()


class StaticReplicas:
    """A fixed list of replicas named ``"0"``, ``"1"``, ... whose status comes from ``fetchers``
    (no routing stats, no cache events): tests and in-process routers.

    Args:
        fetchers: one coroutine function per replica returning its ``status()`` dict.
    """

    def __init__(self, fetchers: list[Callable[[], Awaitable[dict]]]) -> None:
        self.fetchers = list(fetchers)

    def watch(self, on_change: Callable[[list[ReplicaEntry]], None]) -> None:
        on_change([ReplicaEntry(str(i)) for i in range(len(self.fetchers))])

    async def status(self, replica_id: str) -> dict:
        return await self.fetchers[int(replica_id)]()

    async def cache_events(self, replica_id: str) -> AsyncIterator[dict]:
        return
        yield   # an async generator that ends at once

    def close(self) -> None:
        pass
