"""Recurrent-state slots on the coordinator: handed out with blocks on admission, lowest first,
given back on finish and preemption, sent to the workers once per admission (CPU only)."""

from __future__ import annotations

import pytest

from shardserve.cluster.engine.block_manager import BlockManager
from shardserve.cluster.engine.engine import EngineCore
from shardserve.cluster.engine.request import Request, RequestStatus, SamplingParams
from shardserve.cluster.engine.scheduler import Scheduler, SchedulerConfig
from shardserve.cluster.engine.state_slots import StateSlots


def make_scheduler(num_slots=2, num_blocks=16, block_size=4, budget=64):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), bm, StateSlots(num_slots))


def test_lowest_free_slot_first_and_double_free_caught():
    slots = StateSlots(3)
    a, b, c, d = (Request(x, [1], SamplingParams()) for x in "abcd")
    assert all(slots.allocate(r) for r in (a, b, c)) and [r.state_slot for r in (a, b, c)] == [0, 1, 2]
    assert not slots.allocate(d) and d.state_slot is None
    slots.free(b)
    slots.free(b)                       # idempotent: the request no longer holds a slot
    assert slots.allocate(d) and d.state_slot == 1 and slots.num_free == 0
    b.state_slot = 1                    # a stale copy of a slot id
    with pytest.raises(AssertionError, match="freed twice"):
        slots.free(b)


def test_admission_needs_a_slot_and_finish_returns_it():
    s = make_scheduler(num_slots=1)
    a, b = Request("a", [1, 2, 3], SamplingParams()), Request("b", [4, 5], SamplingParams())
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [n.req_id for n in batch.plan.new_requests] == ["a"] and batch.plan.new_requests[0].state_slot == 0
    assert b.status == RequestStatus.WAITING and not b.block_ids, "b waits for a slot, holding no blocks"
    a.output_token_ids.append(7)   # the step's result (EngineCore.update)
    a.num_placeholders = 0
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    batch = s.schedule()
    assert batch.plan.finished_req_ids == ["a"]
    assert [(n.req_id, n.state_slot) for n in batch.plan.new_requests] == [("b", 0)]


def test_preemption_frees_the_slot_and_readmission_sends_one_again():
    s = make_scheduler(num_slots=2, num_blocks=3, budget=64)
    a, b = Request("a", list(range(5)), SamplingParams()), Request("b", list(range(4)), SamplingParams())
    s.add(a)
    s.add(b)
    s.schedule()                        # a: 2 blocks, b: 1 block, slots 0 and 1
    assert (a.state_slot, b.state_slot) == (0, 1)
    for request in (a, b):              # the step's results (EngineCore.update)
        request.output_token_ids.append(9)
        request.num_placeholders = 0
    batch = s.schedule()                # b needs a second block: the newest request (b) is preempted
    assert batch.preempted == [b] and b.state_slot is None and s.state_slots.num_free == 1
    assert s.num_preemptions == 1 and batch.plan.finished_req_ids == ["b"], "workers forget b's state"
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    batch = s.schedule()
    assert batch.plan.finished_req_ids == ["a"]
    assert [(n.req_id, n.state_slot) for n in batch.plan.new_requests] == [("b", 0)]
    assert batch.plan.scheduled[0].start_pos == 0, "a preempted request is recomputed from position 0"


def test_finish_notices_wait_for_an_executed_plan():
    """A plan with nothing scheduled is not executed: the workers hear about finished requests in the
    next plan that runs, so their per-request state (and slot bookkeeping) is never leaked."""
    s = make_scheduler()
    a = Request("a", [1, 2], SamplingParams())
    s.add(a)
    s.schedule()
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    empty = s.schedule()
    assert not empty.plan.scheduled and not empty.plan.finished_req_ids
    s.add(Request("b", [3], SamplingParams()))
    assert s.schedule().plan.finished_req_ids == ["a"]


def test_worker_loss_and_a_reload_abort_give_every_slot_back():
    """In-place recovery ends every request (``fail_all``) and a reload in abort mode ends the started
    ones and requeues the rest: every state slot returns to the pool, and a requeue is no preemption."""
    core = EngineCore(None, None, 16, 4, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), set(),
                      vocab_size=100, enable_prefix_caching=False, num_state_slots=3)
    ids = [core.add_request([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(3)]
    core.schedule()
    slots = core.scheduler.state_slots
    assert slots.num_free == 0
    for tracked in core.requests.values():                            # the step is back (EngineCore.update) ...
        tracked.request.num_placeholders = 0
    core.requests[ids[0]].request.output_token_ids.append(5)          # ... and one has streamed a token
    outputs = core.interrupt_started("reloading")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(ids[0], "abort")]
    assert slots.num_free == 3 and core.scheduler.num_preemptions == 0
    batch = core.schedule()                                           # the two requeued ones run again
    assert sorted(batch.plan.finished_req_ids) == sorted(ids), "the workers forget all three"
    assert sorted(n.state_slot for n in batch.plan.new_requests) == [0, 1]
    assert {o.finish_reason for o in core.fail_all("worker died")} == {"error"}
    assert slots.num_free == 3 and core.block_manager.num_free_blocks == 16 and not core.has_unfinished()
    core.reset_after_worker_loss()                                    # the repaired workers know no request
    assert core.schedule().plan.finished_req_ids == []
