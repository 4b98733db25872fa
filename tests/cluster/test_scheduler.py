"""Scheduler: token budget, chunked prefill, decode, preemption and resume (CPU only, no model)."""

from __future__ import annotations

from shardserve.cluster.engine.block_manager import BlockManager
from shardserve.cluster.engine.request import Request, RequestStatus, SamplingParams
from shardserve.cluster.engine.scheduler import Scheduler, SchedulerConfig
from shardserve.workers.messages import PLACEHOLDER_TOKEN


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=8):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), bm)


def finish_step(batch, next_token=0):
    """What the engine does after a step: append a token to every request that sampled (and give
    back the placeholder the scheduler counted for it)."""
    for req, sched in zip(batch.requests, batch.plan.scheduled):
        if sched.sample:
            req.num_placeholders -= 1
            req.output_token_ids.append(next_token)


def test_chunked_prefill_then_decode():
    s = make_scheduler(budget=8)
    req = Request("a", list(range(13)), SamplingParams())
    s.add(req)
    b1 = s.schedule()
    assert [len(x.token_ids) for x in b1.plan.scheduled] == [8] and not b1.plan.scheduled[0].sample
    assert [n.req_id for n in b1.plan.new_requests] == ["a"]
    assert b1.plan.scheduled[0].new_block_ids == [0, 1]
    finish_step(b1)
    b2 = s.schedule()
    sched = b2.plan.scheduled[0]
    assert (sched.start_pos, sched.token_ids, sched.sample) == (8, list(range(8, 13)), True)
    assert sched.new_block_ids == [2, 3] and not b2.plan.new_requests
    finish_step(b2, next_token=77)
    b3 = s.schedule()
    assert b3.plan.scheduled[0].token_ids == [77] and b3.plan.scheduled[0].start_pos == 13
    assert b3.plan.scheduled[0].output_index == 1


def test_budget_shared_running_first():
    s = make_scheduler(budget=6)
    a, b = Request("a", [1, 2, 3], SamplingParams()), Request("b", [4, 5, 6, 7, 8], SamplingParams())
    s.add(a), s.add(b)
    b1 = s.schedule()
    assert [(x.req_id, len(x.token_ids)) for x in b1.plan.scheduled] == [("a", 3), ("b", 3)]
    finish_step(b1)
    b2 = s.schedule()
    assert [(x.req_id, len(x.token_ids)) for x in b2.plan.scheduled] == [("a", 1), ("b", 2)]


def test_preempts_newest_and_resumes():
    s = make_scheduler(num_blocks=4, block_size=2, budget=16)
    a, b = Request("a", [1, 2, 3], SamplingParams()), Request("b", [4, 5, 6], SamplingParams())
    s.add(a), s.add(b)
    finish_step(s.schedule())               # a: 2 blocks, b: 2 blocks, pool empty
    finish_step(s.schedule())               # 4th token of each still fits their 2nd block
    assert s.block_manager.num_free_blocks == 0
    batch = s.schedule()                     # a needs a 3rd block -> b (newest) is preempted
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [x.req_id for x in batch.plan.scheduled] == ["a"]
    assert batch.plan.finished_req_ids == ["b"]  # workers drop b's state in this very step
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    resumed = s.schedule()
    assert resumed.plan.finished_req_ids == ["a"]
    assert [n.req_id for n in resumed.plan.new_requests] == ["b"]
    sched = resumed.plan.scheduled[0]
    assert sched.token_ids == [4, 5, 6, 0, 0] and sched.start_pos == 0 and sched.output_index == 2


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add(Request(str(i), [1], SamplingParams()))
    assert len(s.schedule().plan.scheduled) == 2 and len(s.waiting) == 1


def test_finish_frees_blocks_and_is_idempotent():
    s = make_scheduler()
    req = Request("a", list(range(9)), SamplingParams())
    s.add(req)
    s.schedule()
    s.finish(req, RequestStatus.FINISHED_ABORTED)
    s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert s.block_manager.num_free_blocks == 16 and s.num_unfinished == 0


def test_paused_admission_keeps_fresh_requests_waiting_but_readmits_preempted_ones():
    s = make_scheduler(num_blocks=4, block_size=4, budget=16)
    started = Request("started", list(range(6)), SamplingParams())
    fresh = Request("fresh", list(range(3)), SamplingParams())
    s.add(started)
    finish_step(s.schedule())             # prefilled, one output token
    s.admit_new = False                   # a weight reload drains
    s.add(fresh)
    s.requeue(started)                    # e.g. preempted: back at the front, its blocks freed
    assert s.block_manager.num_free_blocks == 4 and started.num_computed_tokens == 0
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["started"] and list(s.waiting) == [fresh]
    assert batch.plan.scheduled[0].token_ids == list(range(6)) + [0]   # recomputed from its first token
    s.admit_new = True
    assert [r.request_id for r in s.schedule().requests] == ["started", "fresh"]


def test_async_scheduling_sends_a_placeholder_for_the_token_in_flight():
    """The next step is scheduled before the last result is back (coordinator's pipelined loop):
    the decode computes the token being sampled at its position as a placeholder, the output index
    counts it, and a request whose in-flight tokens reach max_tokens is not scheduled again."""
    s = make_scheduler(budget=16)
    req = Request("a", list(range(5)), SamplingParams(max_tokens=3))
    s.add(req)
    b1 = s.schedule()
    assert b1.plan.scheduled[0].sample and req.num_placeholders == 1
    b2 = s.schedule()                                   # b1 still in flight
    sched = b2.plan.scheduled[0]
    assert (sched.token_ids, sched.start_pos, sched.sample, sched.output_index) == ([PLACEHOLDER_TOKEN], 5, True, 1)
    assert req.num_placeholders == 2 and req.num_computed_tokens == 6
    finish_step(b1, next_token=40)
    b3 = s.schedule()                                   # b2 in flight: its token is the third and last
    assert b3.plan.scheduled[0].token_ids == [PLACEHOLDER_TOKEN] and b3.plan.scheduled[0].output_index == 2
    assert not s.schedule().plan.scheduled              # 1 output + 2 in flight = max_tokens: nothing to add
    finish_step(b2, next_token=41)
    assert req.all_token_ids[5:] == [40, 41] and req.num_placeholders == 1


def test_preempted_request_waits_for_its_tokens_in_flight():
    """A request preempted while steps sample for it is not recomputed before those tokens are back
    (the recompute's prompt would miss them)."""
    s = make_scheduler(num_blocks=3, block_size=4, budget=16)
    a = Request("a", list(range(7)), SamplingParams())
    b = Request("b", list(range(100, 103)), SamplingParams())
    s.add(a)
    s.add(b)
    b1 = s.schedule()                                   # a: blocks 0-1, b: block 2; the pool is full
    b2 = s.schedule()                                   # both decode positions 7 and 3 on placeholders
    assert [x.token_ids for x in b2.plan.scheduled] == [[PLACEHOLDER_TOKEN]] * 2
    b3 = s.schedule()                                   # a's position 8 needs a block: b is preempted
    assert b3.preempted == [b] and b.num_placeholders == 2 and b in s.waiting
    assert [x.req_id for x in b3.plan.scheduled] == ["a"]
    s.finish(a, RequestStatus.FINISHED_STOPPED)         # blocks free, but b's tokens are not back
    assert not s.schedule().plan.scheduled
    finish_step(b1, next_token=9)
    finish_step(b2, next_token=10)
    again = s.schedule()
    assert [x.req_id for x in again.plan.scheduled] == ["b"]
    assert again.plan.scheduled[0].token_ids == [100, 101, 102, 9, 10] and again.plan.scheduled[0].start_pos == 0


def test_prefill_budget_spreads_a_burst_and_spares_decodes():
    """``max_prefill_tokens``: a burst of prompts starts over several steps (the first ones sample
    after one short step), running decodes are never held back by it, and a prompt longer than
    the budget continues as chunks within it."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens=6), bm)
    burst = [Request(f"r{i}", list(range(10 * i, 10 * i + 3)), SamplingParams()) for i in range(4)]
    for req in burst:
        s.add(req)
    b1 = s.schedule()
    assert [(x.req_id, len(x.token_ids), x.sample) for x in b1.plan.scheduled] == [("r0", 3, True), ("r1", 3, True)]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    finish_step(b1)
    b2 = s.schedule()   # two decodes, not counted against the prompt budget, then the next two prompts
    assert [(x.req_id, len(x.token_ids)) for x in b2.plan.scheduled] == [("r0", 1), ("r1", 1), ("r2", 3), ("r3", 3)]
    finish_step(b2)
    long = Request("long", list(range(100, 109)), SamplingParams())
    s.add(long)
    b3 = s.schedule()
    assert [(x.req_id, len(x.token_ids)) for x in b3.plan.scheduled][-1] == ("long", 6)
    assert not b3.plan.scheduled[-1].sample
    finish_step(b3)
    b4 = s.schedule()   # its last 3 prompt tokens as a chunk within the budget, and it samples
    assert [(x.req_id, len(x.token_ids), x.sample) for x in b4.plan.scheduled][-1] == ("long", 3, True)
    assert len(b4.plan.scheduled) == 5


def test_prefill_budget_default_only_on_cpu():
    from shardserve.cluster.config import CPU_MAX_PREFILL_TOKENS, EngineArgs

    assert EngineArgs().prefill_budget(on_cpu=True) == CPU_MAX_PREFILL_TOKENS
    assert EngineArgs().prefill_budget(on_cpu=False) is None
    assert EngineArgs(max_prefill_tokens=512).prefill_budget(on_cpu=True) == 512
    import pytest

    with pytest.raises(ValueError, match="max-prefill-tokens"):
        EngineArgs(max_prefill_tokens=0).validate()


def test_a_prefix_hit_gives_back_its_last_block_only_while_the_draft_model_caches_prompts():
    """With MTP the draft cache entry of a hit's last position depends on the token after it, so a
    request recomputes the hit's last block while the draft model caches prompts; otherwise (no
    speculation, or an adaptive policy that keeps the draft model cold) it keeps every hit."""
    computed = {}
    for recompute in (False, True):
        bm = BlockManager(num_blocks=16, block_size=4)
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=32), bm)
        first = Request("a", list(range(13)), SamplingParams())
        s.add(first)
        s.schedule()
        bm.cache_full_blocks(first)
        s.finish(first, RequestStatus.FINISHED_LENGTH)
        s.recompute_last_hit = recompute
        s.add(Request("b", list(range(13)) + [50], SamplingParams()))
        computed[recompute] = s.schedule().plan.scheduled[0].start_pos
    assert computed == {False: 12, True: 8}
