"""The router's view of its model replicas: state, gRPC address and channel, load, cache digest.

Replicas come and go (Serve's autoscaling, upgrades, restarts): each is known by its Serve replica
id (:mod:`cluster.frontend.replica_directory`) from the moment Serve lists it until Serve drops it.
Which ready replica a request goes to is :mod:`cluster.routing`'s choice; the pool keeps what that
choice reads: each replica's *outstanding tokens* and *requests* (work this router has sent it and
that is not done yet) and its prefix-cache digest. A request costs ``n * (prompt + max output)``
tokens when it is sent (the prompt part less what the chosen replica is expected to hold in its
prefix cache); the prompt part is paid back when its first response arrives (the prefill is
done), one token per generated token, and the rest when it ends.

A replica's address changes when Serve replaces it (rolling upgrade, restart), and a replica that
Serve drops may still run requests. The channel to an old address stays open until the requests
leased on it end, so a switch never cuts a running stream; it is closed then.

Each replica's status carries the internal token it made at start-up (``token``): the router's
only credential to it (:mod:`cluster.frontend.security`), kept here and in each lease, never in
:meth:`Replica.describe`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from shardserve.cluster.routing import LEAST_LOADED, CacheDigest, Candidate, Decision, RoutingPolicy

logger = logging.getLogger(__name__)

LOADING, READY, FAILED, UNREACHABLE = "loading", "ready", "failed", "unreachable"
RECOVERING = "recovering"   # repairing a dead shard / draft worker in place (cluster/replica/recovery.py)


class NoReplicaReady(RuntimeError):
    """No replica can take a request (all loading, failed or unreachable)."""


@dataclass(slots=True)
class Replica:
    """One model replica as the router sees it."""

    key: str                       # Serve's replica id ("0", "1", ... for a static list)
    state: str = LOADING           # loading | ready | recovering | failed | unreachable
    address: str | None = None     # host:port of its gRPC API
    error: str | None = None       # why it is failed or unreachable
    info: dict = field(default_factory=dict)    # last ModelInfo answer (model, max_model_len, blocks, ...)
    stats: dict = field(default_factory=dict)   # last routing stats Serve relayed (load, cache counters)
    digest: CacheDigest = field(default_factory=CacheDigest)   # what its prefix cache holds
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    last_used: int = 0             # routing order stamp (ties: least recently used first)
    unreachable_since: float = 0.0  # monotonic time it turned unreachable
    channel: object = None         # grpc.aio channel to ``address``
    stub: object = None            # InferenceStub on ``channel``
    token: str | None = field(default=None, repr=False)   # the replica's internal token (secret)
    local_path: str | None = None  # its local link's socket when it is on this machine (else gRPC)

    @property
    def metadata(self) -> tuple:
        """gRPC call metadata that authenticates the router to this replica."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def describe(self) -> dict:
        """JSON-safe summary (``/admin/status``; no secret)."""
        return {"id": self.key, "state": self.state, "address": self.address, "error": self.error,
                "outstanding_tokens": self.outstanding_tokens, "outstanding_requests": self.outstanding_requests,
                "cached_blocks": len(self.digest.blocks)}


class Lease:
    """The outstanding tokens one request holds on its replica, and the channel it uses.

    Args:
        replica: where the request runs.
        prompt_tokens: prompt tokens still to prefill (all of them, over every choice).
        output_tokens: output tokens it may still produce (over every choice).
        pool: the pool that keeps the replica's channel open until :meth:`release`.
        decision: why the routing policy chose ``replica`` (None: no policy was asked).
    """

    def __init__(self, replica: Replica, prompt_tokens: int, output_tokens: int,
                 pool: ReplicaPool | None = None, decision: Decision | None = None) -> None:
        self.replica, self.prompt_tokens, self.output_tokens = replica, prompt_tokens, output_tokens
        self.decision = decision
        self.channel, self.stub = replica.channel, replica.stub   # kept even if the replica moves
        self.metadata = replica.metadata                           # likewise its credential
        self.local_path = replica.local_path                       # and its local link
        replica.outstanding_tokens += prompt_tokens + output_tokens
        replica.outstanding_requests += 1
        self._pool = pool
        self._released = False
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
        if not self._released:
            self._released = True
            self.replica.outstanding_requests -= 1
        if self._pool is not None:
            self._pool._unhold(self.channel)
            self._pool = None


class ReplicaPool:
    """Replica states, fed by the replica directory and status polls, and routing through a
    :class:`cluster.routing.RoutingPolicy`.

    Args:
        keys: the replicas known at start (more are :meth:`add`-ed as Serve lists them).
        connect: ``address -> (channel, stub)``; called when a replica's address appears or
            changes (the old channel is closed through ``close``).
        close: closes a channel returned by ``connect``.
        policy: how a replica is chosen (default: least-loaded).
    """

    def __init__(self, keys: Iterable[str] = (), connect: Callable[[str], tuple] | None = None,
                 close: Callable[[object], None] | None = None, policy: RoutingPolicy | None = None) -> None:
        self.replicas: list[Replica] = []
        self._by_key: dict[str, Replica] = {}
        self._connect, self._close = connect, close
        self.policy = policy or RoutingPolicy(LEAST_LOADED)
        self._stamp = itertools.count(1)
        self._holds: dict[int, int] = {}        # id(channel) -> leases using it
        self._retired: dict[int, object] = {}   # id(channel) -> replaced channel, closed when unheld
        self.removed_at = 0.0                   # monotonic time a replica was last dropped
        for key in keys:
            self.add(key)

    def get(self, key: str) -> Replica | None:
        return self._by_key.get(key)

    def add(self, key: str) -> Replica:
        """A replica Serve lists (idempotent)."""
        replica = self._by_key.get(key)
        if replica is None:
            replica = self._by_key[key] = Replica(key)
            self.replicas.append(replica)
        return replica

    def remove(self, key: str) -> None:
        """Serve dropped the replica (scaled down, replaced, dead): no new request goes there;
        running ones keep their channel until they end."""
        replica = self._by_key.pop(key, None)
        if replica is None:
            return
        self.replicas.remove(replica)
        self._drop_channel(replica)
        self.removed_at = time.monotonic()
        logger.info("replica %s left the pool (%d left)", key, len(self.replicas))

    def sync(self, keys: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the pool hold exactly ``keys``; returns ``(added, removed)``."""
        wanted = list(dict.fromkeys(keys))
        removed = [r.key for r in self.replicas if r.key not in wanted]
        added = [key for key in wanted if key not in self._by_key]
        for key in removed:
            self.remove(key)
        for key in added:
            self.add(key)
        return added, removed

    def update(self, key: str, status: dict) -> None:
        """Apply a replica's ``status()`` answer: ``{"state", "address", "error", "info", "token"}``."""
        replica = self._by_key.get(key)
        if replica is None:   # dropped while its status call was on the way
            return
        address = status.get("address")
        if address != replica.address:
            self._drop_channel(replica)
            replica.address = address
            if address and self._connect is not None:
                replica.channel, replica.stub = self._connect(address)
                logger.info("replica %s serves gRPC on %s", key, address)
        local = status.get("local_address")
        # The socket's directory is a fresh random name on the replica's machine: seen here, it is
        # this machine (the same Kubernetes pod, or a plain host), and the link skips HTTP/2.
        replica.local_path = local if local and os.path.exists(local) else None
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
            logger.warning("replica %s unreachable: %s", replica.key, error)
            replica.state, replica.error = UNREACHABLE, error
            replica.unreachable_since = time.monotonic()

    def in_transition(self, max_age_s: float) -> bool:
        """Some replica served and stopped answering, or was dropped, less than ``max_age_s`` ago
        (being replaced): worth waiting for, unlike one that is failed, still loading or gone for longer."""
        now = time.monotonic()
        return (now - self.removed_at < max_age_s
                or any(r.state == UNREACHABLE and now - r.unreachable_since < max_age_s for r in self.replicas))

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == READY]

    def any_info(self) -> dict:
        """ModelInfo of some replica that reported one (empty before any did)."""
        for replica in self.replicas:
            if replica.info:
                return replica.info
        return {}

    def pick(self, prompt_tokens: int, output_tokens: int, exclude: tuple[str, ...] = (),
             hashes: Sequence[int] = ()) -> Lease:
        """Lease the ready replica the routing policy chooses for a prompt whose full blocks hash to
        ``hashes`` (see :mod:`cluster.routing`); the prompt part of the cost is what the chosen
        replica is not expected to hold in its prefix cache.

        Raises:
            NoReplicaReady: every replica is loading, failed, unreachable or excluded.
        """
        by_key = {r.key: r for r in self.ready() if r.key not in exclude}
        if not by_key:
            raise NoReplicaReady(self.summary())
        candidates = [Candidate(r.key, r.outstanding_requests, r.outstanding_tokens, r.last_used, r.digest)
                      for r in by_key.values()]
        decision = self.policy.choose(candidates, hashes)
        best = by_key[decision.key]
        best.last_used = next(self._stamp)
        if hashes:
            best.digest.note_routed(hashes)
        block_size = int(best.info.get("block_size") or 0)
        return Lease(best, max(0, prompt_tokens - decision.matched_blocks * block_size), output_tokens, self,
                     decision)

    def summary(self) -> str:
        """E.g. ``"0/2 replicas ready (replica a1b2: loading; replica c3d4: failed: ...)"``."""
        parts = [f"replica {r.key}: {r.state}" + (f": {r.error}" if r.error else "") for r in self.replicas]
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
