"""Which replica takes a request: the least-loaded one, or the one whose prefix cache holds the
longest prefix of it unless that replica is too busy (prefix-aware with a load guard).

Sources: SGLang's cache-aware router (route to the worker with the longest cached prefix unless
the load is imbalanced, then to the least-loaded one), llm-d's KV-event scorer (the cache state
comes from the engines' block-hash events, not from a model of them), Ray Serve LLM's
``PrefixCacheAffinityRouter`` (a queue-length imbalance threshold).

What a replica holds is a :class:`CacheDigest`: the block hashes its block manager has
registered (``cluster/engine/block_manager.py``), kept exact by the replica's cache events
(``reset`` with a snapshot, then ``stored`` / ``removed``; :meth:`cluster.replica.coordinator.Coordinator.cache_events`).
The router hashes a prompt with the replica's own chain (:func:`prompt_block_hashes`: xxh3 over
the parent hash and the block's token ids, starting from :func:`cluster.engine.block_manager.cache_seed`
of the caller's key digest and ``cache_salt``), so a prompt only ever matches blocks of its own
tenant. Block ids are shared by every cache of a sequence, so a hit covers the KV or MLA latent
blocks and the DSA indexer-key blocks alike.

Between routing a prompt and the replica announcing its blocks (the prefill), the router keeps the
prompt's hashes as *pending* on the replica it chose (:meth:`CacheDigest.note_routed`), so a second
request with the same prefix that arrives meanwhile follows the first; pending hashes expire after
``pending_ttl_s`` or become confirmed by the replica's events.

Policies (``--routing``):

- ``least-loaded``: the replica with the fewest outstanding tokens (ties: least recently used).
- ``prefix-aware`` (the default with more than one replica): the replica whose cache holds the
  longest prefix of the prompt, when it is longer than what the least-loaded replica holds; but if
  that replica has more than ``load_margin`` requests outstanding beyond the least-loaded one's
  (the load guard), the least-loaded one. Every decision names its reason (``cache``,
  ``load_guard``, ``least_loaded``) for ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shardserve.cluster.engine.block_manager import block_hash

LEAST_LOADED, PREFIX_AWARE = "least-loaded", "prefix-aware"
ROUTING_POLICIES = (LEAST_LOADED, PREFIX_AWARE)
DEFAULT_LOAD_MARGIN = 8          # requests: how much busier than the least-loaded replica a cache hit may be
DEFAULT_PENDING_TTL_S = 30.0     # seconds a routed prompt's blocks count as coming on its replica

# Decision reasons (the ``reason`` label of shardserve_routing_decisions_total).
CACHE, LOAD_GUARD, LEAST = "cache", "load_guard", "least_loaded"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The chained hashes of the full blocks a replica could take from its prefix cache for this
    prompt: ``(len - 1) // block_size`` blocks (the last token is always computed), exactly as
    :meth:`cluster.engine.block_manager.BlockManager.get_computed_blocks` walks them.

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per KV block (the replicas' ``block_size``).
        seed: the chain's first parent (:func:`cluster.engine.block_manager.cache_seed` of the
            caller's tenant and ``cache_salt``).

    Returns:
        One 64-bit hash per full block, in order.
    """
    hashes, parent = [], seed
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class CacheDigest:
    """One replica's prefix cache as the router knows it.

    Attributes:
        blocks: block hashes the replica reported as cached (its events applied in order).
        pending: hash -> monotonic expiry time, for prompts routed here whose blocks the replica
            has not announced yet.
        synced: a snapshot (``reset``) has arrived: ``blocks`` mirrors the replica.
    """

    blocks: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)
    synced: bool = False

    def apply(self, reset: bool, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Apply one event message: ``reset`` drops everything first (the snapshot or a cleared
        cache follows in ``stored``), then ``stored`` hashes are added and ``removed`` ones dropped."""
        if reset:
            self.blocks.clear()
            self.synced = True
        for digest in stored:
            self.blocks.add(digest)
            self.pending.pop(digest, None)
        self.blocks.difference_update(removed)

    def note_routed(self, hashes: Sequence[int], ttl_s: float = DEFAULT_PENDING_TTL_S,
                    now: float | None = None) -> None:
        """``hashes`` were just sent here: count them as cached until the replica confirms them or
        ``ttl_s`` passes."""
        expiry = (time.monotonic() if now is None else now) + ttl_s
        for digest in hashes:
            if digest not in self.blocks:
                self.pending[digest] = expiry

    def match(self, hashes: Sequence[int], now: float | None = None) -> int:
        """How many leading ``hashes`` this replica holds (reported or pending)."""
        now = time.monotonic() if now is None else now
        for count, digest in enumerate(hashes):
            if digest in self.blocks:
                continue
            expiry = self.pending.get(digest)
            if expiry is None or expiry < now:
                return count
        return len(hashes)

    def expire(self, now: float | None = None) -> None:
        """Forget pending hashes past their expiry."""
        now = time.monotonic() if now is None else now
        for digest in [d for d, expiry in self.pending.items() if expiry < now]:
            del self.pending[digest]


@dataclass(slots=True)
class Candidate:
    """A ready replica the policy may choose (the router's view of its load)."""

    key: str                       # the replica's id
    outstanding_requests: int      # requests routed there and not finished
    outstanding_tokens: int        # tokens routed there and not yet done (see cluster/frontend/replica_pool.py)
    last_used: int = 0             # routing order stamp (ties: least recently used first)
    digest: CacheDigest | None = None


@dataclass(slots=True)
class Decision:
    """Where a request goes and why."""

    key: str                       # the chosen replica's id
    reason: str                    # CACHE, LOAD_GUARD or LEAST
    matched_blocks: int            # leading prompt blocks the chosen replica holds


class RoutingPolicy:
    """Chooses a replica among ready candidates.

    Args:
        name: ``least-loaded`` or ``prefix-aware``.
        load_margin: requests a replica holding the longest prefix may have outstanding beyond the
            least-loaded replica before the least-loaded one is chosen instead.

    Raises:
        ValueError: an unknown policy or a negative margin.
    """

    def __init__(self, name: str = PREFIX_AWARE, load_margin: int = DEFAULT_LOAD_MARGIN) -> None:
        if name not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {name!r}")
        if load_margin < 0:
            raise ValueError(f"routing load margin must be >= 0 requests, got {load_margin}")
        self.name, self.load_margin = name, load_margin

    @property
    def uses_cache(self) -> bool:
        """Whether decisions read prompt hashes (the router computes them only then)."""
        return self.name == PREFIX_AWARE

    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[int] = (),
               now: float | None = None) -> Decision:
        """The replica for a prompt whose full blocks hash to ``hashes``.

        Raises:
            ValueError: no candidate.
        """
        if not candidates:
            raise ValueError("no replica to choose from")
        least = min(candidates, key=lambda c: (c.outstanding_tokens, c.last_used))
        if not self.uses_cache or not hashes:
            return Decision(least.key, LEAST, 0)
        now = time.monotonic() if now is None else now
        matched = {c.key: c.digest.match(hashes, now) if c.digest is not None else 0 for c in candidates}
        best = min(candidates, key=lambda c: (-matched[c.key], c.outstanding_tokens, c.last_used))
        if matched[best.key] <= matched[least.key]:
            return Decision(least.key, CACHE if matched[least.key] else LEAST, matched[least.key])
        if best.outstanding_requests > least.outstanding_requests + self.load_margin:
            return Decision(least.key, LOAD_GUARD, matched[least.key])
        return Decision(best.key, CACHE, matched[best.key])
