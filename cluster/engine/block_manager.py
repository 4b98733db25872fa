"""KV block pool with prefix caching: ref counts, chained block hashes, an LRU free queue.

Follows nano-vllm's block manager and vLLM's ``KVCacheManager``: a block's hash covers its tokens
and its predecessor's hash, so equal hashes mean equal prefixes; a hit is confirmed by comparing
token ids (guards hash collisions). Blocks are hashed only once full. Freed blocks keep their
hash and stay reusable until evicted from the front of the free queue; two blocks may hold one
hash (requests that computed a prefix side by side), and the prefix stays cached while either
lives (as vLLM's hash-to-blocks map). Block ids are shared by
every cache of a sequence (KV, MLA latent, DSA indexer keys, draft model caches).

Tenants: the chain of a request starts from its ``cache_seed`` (:func:`cache_seed` of its tenant,
the API key's digest, and its own ``cache_salt``, as vLLM's ``cache_salt``), so requests of
different keys or salts never share a block: one tenant cannot learn from hit timings or counts
whether another sent a prompt.

Cache events (llm-d's KV events, vLLM's ``BlockStored`` / ``BlockRemoved``): while
:attr:`BlockManager.events` is a list, every change of the prefix cache's hash map is appended to
it: ``(STORED, hash)`` when a full block is registered, ``(REMOVED, hash)`` when a cached block is
evicted, ``(CLEARED, 0)`` when the whole cache is dropped. The coordinator hands them to the router
(:mod:`cluster.routing` keeps each replica's set of hashes exact from them). ``None`` (nobody
listens) records nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from shardserve.cluster.engine.request import Request

STORED, REMOVED, CLEARED = 0, 1, 2   # cache event kinds


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None               # set once full and registered in the prefix cache
    token_ids: tuple[int, ...] | None = None


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    """Chained 64-bit hash of one full block (xxh3 over parent hash + int64 token ids)."""
    h = xxhash.xxh3_64()
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def cache_seed(tenant: str = "", cache_salt: str = "") -> int:
    """The first parent hash of a request's block chain: 0 (shared) when both are empty."""
    if not tenant and not cache_salt:
        return 0
    return xxhash.xxh3_64_intdigest(f"{tenant}\x00{cache_salt}".encode("utf-8", "surrogatepass")) or 1


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        num_blocks: blocks in the pool (the smallest count any rank could allocate).
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks across requests with equal prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        # Other blocks holding a cached hash (two requests computed one prefix side by side, or a
        # block re-registered one whose copy sits in the free queue): one takes over when the block
        # in ``cached`` is evicted, so the prefix stays cached while any copy lives.
        self._copies: dict[int, list[int]] = {}
        self.prefix_hits = 0               # prompt tokens served from the prefix cache (metric)
        self.prefix_queries = 0            # prompt tokens looked up in the prefix cache (metric, as vLLM's)
        self.events: list[tuple[int, int]] | None = None   # (kind, hash) while someone listens

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``request``'s tokens, in full blocks.

        At least one token is always left to compute (the step that samples needs its logits).

        Returns:
            ``(block ids, number of tokens they cover)``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        hits, parent = [], request.cache_seed
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            parent = block_hash(parent, chunk)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give ``request`` blocks for ``num_computed_tokens + num_new_tokens`` tokens (after
        taking ``computed_blocks`` from the prefix cache). All or nothing.

        Returns:
            False (changing nothing) when the pool cannot supply the blocks.
        """
        have = len(request.block_ids) + len(computed_blocks)
        need = self.blocks_needed(request.num_computed_tokens + len(computed_blocks) * self.block_size
                                  + num_new_tokens) - have
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if max(need, 0) + revived > self.num_free_blocks:
            return False
        if self.enable_prefix_caching and not request.block_ids and not request.num_computed_tokens:
            self.prefix_queries += request.num_tokens   # admitted: its lookup counts once
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        if computed_blocks:   # an admission's hits are registered already; blocks allocated below are not
            request.block_ids.extend(computed_blocks)
            request.num_cached_blocks = len(request.block_ids)
        self.prefix_hits += len(computed_blocks) * self.block_size
        request.num_cached_tokens = max(request.num_cached_tokens, len(computed_blocks) * self.block_size)
        for _ in range(max(need, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached contents
                self._evict(block)
            block.ref_count = 1
            request.block_ids.append(block_id)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register ``request``'s blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        tokens = request.all_token_ids
        # Only tokens known here: with async scheduling a computed position may hold a token that
        # is still being sampled.
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(request.block_ids))
        for i in range(request.num_cached_blocks, num_full):
            parent = self.blocks[request.block_ids[i - 1]].hash if i > 0 else request.cache_seed
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            block = self.blocks[request.block_ids[i]]
            block.hash, block.token_ids = block_hash(parent, chunk), tuple(chunk)
            if self.cached.setdefault(block.hash, block.block_id) != block.block_id:
                self._copies.setdefault(block.hash, []).append(block.block_id)
            elif self.events is not None:
                self.events.append((STORED, block.hash))
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _evict(self, block: Block) -> None:
        """Drop ``block``'s hash; a copy of the block takes its place in :attr:`cached` if one lives."""
        copies = self._copies.get(block.hash, [])
        if self.cached.get(block.hash) != block.block_id:
            copies.remove(block.block_id)
        elif copies:
            self.cached[block.hash] = copies.pop()
        else:
            del self.cached[block.hash]
            if self.events is not None:
                self.events.append((REMOVED, block.hash))
        if not copies:
            self._copies.pop(block.hash, None)
        block.hash, block.token_ids = None, None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after the KV contents were changed outside this manager)."""
        for block in self.blocks:
            block.hash, block.token_ids = None, None
        self.cached.clear()
        self._copies.clear()
        if self.events is not None:
            self.events[:] = [(CLEARED, 0)]

    def listen(self) -> list[int]:
        """Start recording :attr:`events` (idempotent); returns the hashes cached now (the snapshot
        the events follow)."""
        if self.events is None:
            self.events = []
        return list(self.cached)

    def take_events(self) -> list[tuple[int, int]]:
        """The events recorded since the last call (empty when nobody listens)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def free(self, request: Request) -> None:
        """Drop ``request``'s references. Its tail blocks go to the free queue first, so they are
        evicted before the shared prefix blocks."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_cached_blocks = 0
