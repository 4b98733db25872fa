"""Prefix-cache-aware routing (issue 28): the router's block hashes are the replica's, the
replica's cache events keep the router's digest exact, and the policy follows the cache unless
the load guard says otherwise. Oracle: a real :class:`BlockManager` (its ``cached`` map)."""

from __future__ import annotations

import asyncio

import pytest

from shardserve.cluster.engine.block_manager import BlockManager, cache_seed
from shardserve.cluster.engine.request import Request, SamplingParams
from shardserve.cluster.replica.cache_events import CacheEventHub
from shardserve.cluster.routing import (
    CACHE, LEAST, LEAST_LOADED, LOAD_GUARD, PREFIX_AWARE, CacheDigest, Candidate, RoutingPolicy,
    prompt_block_hashes)

BLOCK = 4


def admit(bm: BlockManager, tokens: list[int], rid: str, seed: int = 0) -> Request:
    """Prefill ``tokens`` on ``bm`` as the scheduler would (prefix hit, allocate, register)."""
    req = Request(rid, list(tokens), SamplingParams())
    req.cache_seed = seed
    hits, num = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return req


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 15, 16, 17])
def test_router_hashes_are_the_replica_chain(num_tokens):
    bm = BlockManager(16, BLOCK)
    seed = cache_seed("tenant-digest", "salt")
    tokens = [(7 * i) % 50 for i in range(num_tokens)]
    req = admit(bm, tokens, "a", seed)
    hashes = prompt_block_hashes(tokens, BLOCK, seed)
    assert len(hashes) == (num_tokens - 1) // BLOCK
    assert [bm.cached[h] for h in hashes] == req.block_ids[:len(hashes)]
    # another tenant's chain never matches
    assert not set(prompt_block_hashes(tokens, BLOCK, cache_seed("other", ""))) & set(bm.cached)
    # what the router predicts is what the replica hits
    again = Request("b", list(tokens), SamplingParams())
    again.cache_seed = seed
    assert bm.get_computed_blocks(again)[1] == len(hashes) * BLOCK


def test_cache_events_keep_the_router_digest_exact():
    bm = BlockManager(6, BLOCK)
    hub = CacheEventHub(bm)
    bm.free(admit(bm, list(range(9)), "before"))   # cached before anyone listens: in the snapshot
    digest = CacheDigest()

    async def follow():
        stream = hub.stream(min_interval_s=0)
        message = await anext(stream)
        assert message["reset"] and message["block_size"] == BLOCK
        digest.apply(message["reset"], message["stored"], message["removed"])
        assert digest.blocks == set(bm.cached)
        removed = 0
        for step, tokens in enumerate([list(range(100, 113)), list(range(200, 217)), list(range(9))]):
            bm.free(admit(bm, tokens, f"r{step}"))   # evicts older blocks (6 in the pool); freed ones stay cached
            hub.flush()
            message = await anext(stream)
            digest.apply(message["reset"], message["stored"], message["removed"])
            assert digest.blocks == set(bm.cached), step
            removed += len(message["removed"])
        assert removed, "the pool is small: later prompts evicted cached blocks"
        bm.reset_prefix_cache()
        hub.flush()
        message = await anext(stream)
        assert message["reset"]
        digest.apply(message["reset"], message["stored"], message["removed"])
        assert digest.blocks == set(bm.cached) == set()
        await stream.aclose()
        assert bm.events is None and not hub.listeners   # nobody listens: nothing recorded

    asyncio.run(follow())


def candidates(loads: dict[str, int], digests: dict[str, CacheDigest]) -> list[Candidate]:
    return [Candidate(key, load, load * 100, i, digests.get(key)) for i, (key, load) in enumerate(loads.items())]


def test_prefix_aware_follows_the_longest_prefix_within_the_load_margin():
    hashes = prompt_block_hashes(list(range(40)), BLOCK, 0)
    warm, cold = CacheDigest(), CacheDigest()
    warm.apply(True, hashes[:6], [])
    cold.apply(True, hashes[:2], [])
    policy = RoutingPolicy(PREFIX_AWARE, load_margin=3)
    digests = {"warm": warm, "cold": cold}
    decision = policy.choose(candidates({"warm": 2, "cold": 0}, digests), hashes)
    assert (decision.key, decision.reason, decision.matched_blocks) == ("warm", CACHE, 6)
    # the cached replica is busier than the least-loaded one by more than the margin: load guard
    decision = policy.choose(candidates({"warm": 4, "cold": 0}, digests), hashes)
    assert (decision.key, decision.reason, decision.matched_blocks) == ("cold", LOAD_GUARD, 2)
    # nothing cached anywhere, or least-loaded policy: least loaded
    assert policy.choose(candidates({"a": 1, "b": 0}, {}), hashes).key == "b"
    decision = RoutingPolicy(LEAST_LOADED).choose(candidates({"warm": 1, "cold": 0}, digests), hashes)
    assert (decision.key, decision.reason) == ("cold", LEAST)
    with pytest.raises(ValueError, match="routing must be one of"):
        RoutingPolicy("random")


def test_routed_prompts_count_as_pending_until_confirmed_or_expired():
    hashes = prompt_block_hashes(list(range(40)), BLOCK, 0)
    digest = CacheDigest()
    digest.note_routed(hashes[:5], ttl_s=10, now=100.0)
    assert digest.match(hashes, now=105.0) == 5
    digest.apply(False, hashes[:3], [])           # the replica announced three of them
    assert digest.match(hashes, now=111.0) == 3   # the other two expired
    digest.expire(now=111.0)
    assert not digest.pending
