"""The router's view of its model replicas: state, gRPC address and channel, outstanding tokens.

Routing rule: a request goes to the ready replica with the fewest *outstanding tokens*, the work
this router has sent it and that is not done yet. A request costs ``n * (prompt + max output)``
tokens when it is sent; the prompt part is paid back when its first response arrives (the prefill
is done), one token per generated token, and the rest when it ends. Ties go to the replica used
least recently, so equal replicas take turns.

A replica's address changes when Serve replaces it (rolling upgrade, restart). The channel to the
old address stays open until the requests leased on it end, so a switch never cuts a running
stream; it is closed then.

Each replica's status carries the internal token it made at start-up (``token``): the router's
only credential to it (:mod:`cluster.frontend.security`), kept here and in each lease, never in
:meth:`Replica.describe`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

LOADING, READY, FAILED, UNREACHABLE = "loading", "ready", "failed", "unreachable"
RECOVERING = "recovering"   # repairing a dead shard / draft worker in place (cluster/replica/recovery.py)


class NoReplicaReady(RuntimeError):
    """No replica can take a request (all loading, failed or unreachable)."""


@dataclass(slots=True)
class Replica:
    """One model replica as the router sees it."""

    index: int
    state: str = LOADING           # loading | ready | recovering | failed | unreachable
    address: str | None = None     # host:port of its gRPC API
    error: str | None = None       # why it is failed or unreachable
    info: dict = field(default_factory=dict)   # last ModelInfo answer (model, max_model_len, blocks, ...)
    outstanding_tokens: int = 0
    last_used: int = 0             # routing order stamp (ties: least recently used first)
    unreachable_since: float = 0.0  # monotonic time it turned unreachable
    channel: object = None         # grpc.aio channel to ``address``
    stub: object = None            # InferenceStub on ``channel``
    token: str | None = field(default=None, repr=False)   # the replica's internal token (secret)

    @property
    def metadata(self) -> tuple:
        """gRPC call metadata that authenticates the router to this replica."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def describe(self) -> dict:
        """JSON-safe summary (``/admin/status``; no secret)."""
        return {"index": self.index, "state": self.state, "address": self.address, "error": self.error,
                "outstanding_tokens": self.outstanding_tokens}


class Lease:
    """The outstanding tokens one request holds on its replica, and the channel it uses.

    Args:
        replica: where the request runs.
        prompt_tokens: prompt tokens still to prefill (all of them, over every choice).
        output_tokens: output tokens it may still produce (over every choice).
        pool: the pool that keeps the replica's channel open until :meth:`release`.
    """

    def __init__(self, replica: Replica, prompt_tokens: int, output_tokens: int,
                 pool: ReplicaPool | None = None) -> None:
        self.replica, self.prompt_tokens, self.output_tokens = replica, prompt_tokens, output_tokens
        self.channel, self.stub = replica.channel, replica.stub   # kept even if the replica moves
        self.metadata = replica.metadata                           # likewise its credential
        replica.outstanding_tokens += prompt_tokens + output_tokens
        self._pool = pool
        if pool is not None:
            pool._hold(self.channel)

    def prefilled(self, prompt_tokens: int) -> None:
        """A choice got its first response: ``prompt_tokens`` of the prompt part are done."""
        done = min(prompt_tokens, self.prompt_tokens)
        self.prompt_tokens -= done
        self.replica.outstanding_tokens -= done

    def generated(self, num_tokens: int) -> None:
        """``num_tokens`` output tokens arrived."""
        done = min(num_tokens, self.output_tokens)
        self.output_tokens -= done
        self.replica.outstanding_tokens -= done

    def release(self) -> None:
        """The request ended (finished, failed or cancelled): pay back the rest. Idempotent."""
        self.replica.outstanding_tokens -= self.prompt_tokens + self.output_tokens
        self.prompt_tokens = self.output_tokens = 0
        if self._pool is not None:
            self._pool._unhold(self.channel)
            self._pool = None


class ReplicaPool:
    """Replica states, fed by a status poller, and least-outstanding-tokens routing.

    Args:
        num_replicas: data-parallel size.
        connect: ``address -> (channel, stub)``; called when a replica's address appears or
            changes (the old channel is closed through ``close``).
        close: closes a channel returned by ``connect``.
    """

    def __init__(self, num_replicas: int, connect: Callable[[str], tuple] | None = None,
                 close: Callable[[object], None] | None = None) -> None:
        self.replicas = [Replica(i) for i in range(num_replicas)]
        self._connect, self._close = connect, close
        self._stamp = itertools.count(1)
        self._holds: dict[int, int] = {}        # id(channel) -> leases using it
        self._retired: dict[int, object] = {}   # id(channel) -> replaced channel, closed when unheld

    def update(self, index: int, status: dict) -> None:
        """Apply a replica's ``status()`` answer: ``{"state", "address", "error", "info"}``."""
        replica = self.replicas[index]
        address = status.get("address")
        if address != replica.address:
            self._drop_channel(replica)
            replica.address = address
            if address and self._connect is not None:
                replica.channel, replica.stub = self._connect(address)
                logger.info("replica %d serves gRPC on %s", index, address)
        replica.state = status.get("state", LOADING)
        replica.error = status.get("error")
        if status.get("token"):
            replica.token = status["token"]
        if status.get("info"):
            replica.info = status["info"]
        if replica.state == READY and not replica.info.get("healthy", True):
            replica.state, replica.error = FAILED, "a shard worker died"

    def mark_unreachable(self, replica: Replica, error: str) -> None:
        """The replica failed a call (or its status call); skip it until the poller sees it ready
        again."""
        if replica.state == READY:
            logger.warning("replica %d unreachable: %s", replica.index, error)
            replica.state, replica.error = UNREACHABLE, error
            replica.unreachable_since = time.monotonic()

    def in_transition(self, max_age_s: float) -> bool:
        """Some replica served and stopped answering less than ``max_age_s`` ago (being replaced):
        worth waiting for, unlike one that is failed, still loading or gone for longer."""
        now = time.monotonic()
        return any(r.state == UNREACHABLE and now - r.unreachable_since < max_age_s for r in self.replicas)

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == READY]

    def any_info(self) -> dict:
        """ModelInfo of some replica that reported one (empty before any did)."""
        for replica in self.replicas:
            if replica.info:
                return replica.info
        return {}

    def pick(self, prompt_tokens: int, output_tokens: int, exclude: tuple[int, ...] = ()) -> Lease:
        """Lease the ready replica with the fewest outstanding tokens.

        Raises:
            NoReplicaReady: every replica is loading, failed, unreachable or excluded.
        """
        candidates = [r for r in self.ready() if r.index not in exclude]
        if not candidates:
            raise NoReplicaReady(self.summary())
        best = min(candidates, key=lambda r: (r.outstanding_tokens, r.last_used))
        best.last_used = next(self._stamp)
        return Lease(best, prompt_tokens, output_tokens, self)

    def summary(self) -> str:
        """E.g. ``"0/2 replicas ready (replica 0: loading; replica 1: failed: ...)"``."""
        parts = [f"replica {r.index}: {r.state}" + (f": {r.error}" if r.error else "") for r in self.replicas]
        return f"{len(self.ready())}/{len(self.replicas)} replicas ready ({'; '.join(parts)})"

    def _drop_channel(self, replica: Replica) -> None:
        channel = replica.channel
        if channel is not None and self._close is not None:
            if self._holds.get(id(channel)):
                self._retired[id(channel)] = channel   # running requests still read from it
            else:
                self._close(channel)
        replica.channel = replica.stub = None

    def _hold(self, channel) -> None:
        if channel is not None:
            self._holds[id(channel)] = self._holds.get(id(channel), 0) + 1

    def _unhold(self, channel) -> None:
        if channel is None:
            return
        left = self._holds.pop(id(channel), 0) - 1
        if left > 0:
            self._holds[id(channel)] = left
            return
        retired = self._retired.pop(id(channel), None)
        if retired is not None and self._close is not None:
            self._close(retired)

    def detach_channels(self) -> list:
        """Forget every channel, replaced ones included, and return them (to be closed)."""
        channels = [r.channel for r in self.replicas if r.channel is not None] + list(self._retired.values())
        for replica in self.replicas:
            replica.channel = replica.stub = None
        self._holds.clear()
        self._retired.clear()
        return channels

    def close(self) -> None:
        """Close every channel, replaced ones included."""
        for channel in self.detach_channels():
            if self._close is not None:
                self._close(channel)
