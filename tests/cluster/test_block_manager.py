"""Block manager: exact block ids, ref counts, prefix hits, eviction order, collision guard."""

from __future__ import annotations

from shardserve.cluster.engine.block_manager import REMOVED, STORED, BlockManager, block_hash
from shardserve.cluster.engine.request import Request, SamplingParams


def make_request(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def admit(bm, req):
    hits, num = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return num


def test_allocate_and_free_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(range(10))
    assert admit(bm, req) == 0
    assert req.block_ids == [0, 1, 2]
    assert bm.num_free_blocks == 5
    # A decode token that fits the last block needs no new block; the 13th token does.
    req.output_token_ids = [10, 11]
    assert bm.allocate_slots(req, 2) and req.block_ids == [0, 1, 2]
    req.num_computed_tokens = 12
    req.output_token_ids.append(12)
    assert bm.allocate_slots(req, 1) and req.block_ids == [0, 1, 2, 3]
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_ids == []
    # Tail blocks are freed first: the next fresh allocation evicts them before the prefix.
    assert list(bm.free_queue)[:4] == [4, 5, 6, 7]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_request(range(9), "a")
    admit(bm, first)
    second = make_request(list(range(8)) + [99, 98], "b")
    assert admit(bm, second) == 8              # two full blocks reused
    assert second.block_ids[:2] == first.block_ids[:2]
    assert bm.blocks[first.block_ids[0]].ref_count == 2
    bm.free(first)
    assert bm.blocks[second.block_ids[0]].ref_count == 1
    bm.free(second)
    assert bm.num_free_blocks == 8


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(range(8), "a")
    admit(bm, req)
    bm.free(req)
    again = make_request(range(8), "b")
    hits, num = bm.get_computed_blocks(again)
    assert num == 4 and len(hits) == 1         # the last block is recomputed so logits exist


def test_eviction_reuses_cached_free_blocks_and_forgets_them():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    bm.free(a)
    b = make_request([7, 8, 9, 10, 11], "b")   # needs all 3 blocks: evicts a's cached blocks
    assert admit(bm, b) == 0
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 5]))[1] == 0


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3], "a")
    admit(bm, a)
    block = bm.blocks[a.block_ids[0]]
    block.token_ids = (9, 9)                   # same hash, different tokens: must not match
    assert bm.get_computed_blocks(make_request([1, 2, 3]))[1] == 0


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    req = make_request(range(5))
    assert not bm.allocate_slots(req, 5)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_blocks_filled_by_decoding_are_cached():
    """A block that fills while the request decodes is registered like a prompt block (the next turn
    of a chat reuses the answer). The decode step's allocation once marked every block it found as
    registered, partial ones included, so a block that was partial at the prefill never was."""
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(range(6), "a")
    admit(bm, req)
    for token in range(6, 13):   # decode: allocate for the new token, compute it, then register
        req.output_token_ids.append(token)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        bm.cache_full_blocks(req)
    bm.free(req)
    follow_up = make_request(range(14), "b")
    assert admit(bm, follow_up) == 12


def test_async_scheduling_registers_the_step_before_the_one_sent_ahead():
    """With async scheduling the next step is allocated before the last one's result registers its
    blocks: the prompt's blocks must still reach the prefix cache (a second identical prompt hits)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(range(10), "a")
    hits, num = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num, hits)
    req.num_computed_tokens = req.num_tokens          # the prefill, in flight
    assert bm.allocate_slots(req, 1)                  # the decode sent ahead (a placeholder token)
    req.num_computed_tokens += 1
    bm.cache_full_blocks(req)                         # the prefill's result is back
    req.output_token_ids.append(10)
    bm.free(req)
    again = make_request(range(10), "b")
    assert bm.get_computed_blocks(again)[1] == 8


def test_a_copy_of_a_cached_block_takes_over_when_the_first_is_evicted():
    """Two requests that computed one prefix side by side hold equal blocks; evicting the one the
    hash map points at must leave the prefix cached in the other (no REMOVED event: it still is)."""
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.listen()
    a, b = make_request(range(6), "a"), make_request(range(6), "b")
    for req in (a, b):   # both admitted before either registered its blocks
        assert bm.allocate_slots(req, req.num_tokens)
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        bm.cache_full_blocks(req)
    first = block_hash(0, list(range(4)))
    a_blocks, b_blocks = a.block_ids, b.block_ids
    assert bm.cached[first] == a_blocks[0]
    bm.free(a)
    bm.free(b)
    assert bm.take_events() == [(STORED, first)]
    filler = make_request(range(100, 116), "filler")   # the 2 never-used blocks, then a's (freed first)
    assert bm.allocate_slots(filler, 16) and set(a_blocks) < set(filler.block_ids)
    assert bm.take_events() == []                      # b's copy keeps the prefix cached
    assert bm.get_computed_blocks(make_request(range(6), "c")) == ([b_blocks[0]], 4)
    assert bm.allocate_slots(make_request(range(200, 208), "x"), 8)   # b's blocks go too
    assert bm.cached == {} and bm._copies == {} and bm.take_events() == [(REMOVED, first)]
