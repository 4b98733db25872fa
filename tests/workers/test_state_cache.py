"""The worker's recurrent-state pool bookkeeping (no model): slots zeroed on assignment, position
checks, group layout of a mixed step, and the speculative rollback from a verify step's checkpoint."""

from __future__ import annotations

import pytest
import torch

from shardserve.kernels.gated_delta import gated_delta_recurrent_ref
from shardserve.workers.messages import NewRequestData, SamplingOptions, ScheduledRequest, StepPlan
from shardserve.workers.state_cache import StateCache

SLOTS, CHANNELS, WIDTH, HEADS, DIM = 4, 3, 4, 2, 2


class FakeLayer:
    def __init__(self) -> None:
        self.kv_cache = (torch.ones(SLOTS, CHANNELS, WIDTH - 1), torch.ones(SLOTS, HEADS, DIM, DIM))


def new(req_id: str, slot: int | None) -> NewRequestData:
    return NewRequestData(req_id, SamplingOptions(temperature=0), slot)


def sched(req_id: str, num_tokens: int, start: int, num_spec: int = 0) -> ScheduledRequest:
    return ScheduledRequest(req_id, list(range(num_tokens)), start, [], True, 0, num_spec_tokens=num_spec)


def test_new_requests_get_zeroed_slots_and_a_mixed_step_is_split_by_rule():
    layers = [FakeLayer(), FakeLayer()]
    cache = StateCache(layers)
    meta = cache.begin_step(StepPlan([new("a", 2), new("b", 0)], [sched("a", 5, 0), sched("b", 1, 0)]))
    for layer in layers:
        for tensor in layer.kv_cache:
            assert tensor[[0, 2]].abs().sum() == 0 and torch.equal(tensor[[1, 3]], torch.ones_like(tensor[[1, 3]]))
    assert meta.cu_seqlens.tolist() == [0, 5, 6] and meta.slots.tolist() == [2, 0] and not meta.keep
    assert meta.chunked.token_idx.tolist() == [0, 1, 2, 3, 4] and meta.chunked.slots.tolist() == [2]
    assert meta.recurrent.token_idx.tolist() == [5] and meta.recurrent.cu_seqlens.tolist() == [0, 1]


def test_bad_slots_and_positions_raise():
    cache = StateCache([FakeLayer()])
    with pytest.raises(ValueError, match="state slot None"):
        cache.begin_step(StepPlan([new("a", None)], [sched("a", 2, 0)]))
    cache.begin_step(StepPlan([new("b", 1)], [sched("b", 3, 0)]))
    with pytest.raises(RuntimeError, match="holds 3 tokens but the step starts at position 2"):
        cache.begin_step(StepPlan([], [sched("b", 1, 2)]))


def test_a_slot_reassigned_without_a_finish_notice_drops_the_stale_request():
    cache = StateCache([FakeLayer()])
    cache.begin_step(StepPlan([new("a", 1)], [sched("a", 3, 0)]))
    cache.begin_step(StepPlan([new("b", 1)], [sched("b", 2, 0)]))
    assert list(cache.seqs) == ["b"] and cache.seqs["b"].num_tokens == 2


@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_verify_rolls_back_to_the_accepted_position(accepted):
    """A verify step of 4 tokens (1 real + 3 drafts) at position 10 beside a decode; the next step
    starts after ``accepted`` of them: the window is the last W-1 inputs up to there and the matrix
    state the checkpoint with the accepted tokens folded in again (all 4 accepted: the state after
    the step stays)."""
    layer = FakeLayer()
    cache = StateCache([layer])
    cache.begin_step(StepPlan([new("d", 0), new("v", 3)], [sched("d", 1, 0), sched("v", 10, 0)]))
    meta = cache.begin_step(StepPlan([], [sched("d", 1, 1), sched("v", 4, 10, num_spec=3)]))
    assert meta.keep and meta.recurrent.token_idx is None and meta.recurrent.cu_seqlens.tolist() == [0, 1, 5]
    conv_before = torch.arange(2 * CHANNELS * (WIDTH - 1), dtype=torch.float).view(2, CHANNELS, WIDTH - 1)
    ssm_before = torch.randn(2, HEADS, DIM, DIM)
    conv_inputs = 100 + torch.arange(5 * CHANNELS, dtype=torch.float).view(5, CHANNELS)
    q, k = (torch.nn.functional.normalize(torch.randn(5, 1, DIM), dim=-1) for _ in range(2))
    delta_inputs = (q, k, torch.randn(5, HEADS, DIM), -torch.rand(5, HEADS), torch.rand(5, HEADS))
    meta.snapshots[0] = (conv_before, ssm_before, conv_inputs, delta_inputs)   # what the layer records
    after_step = [t[3].clone() for t in layer.kv_cache]
    cache.begin_step(StepPlan([], [sched("v", 1, 10 + accepted)]))
    conv, ssm = layer.kv_cache
    if accepted == 4:
        assert torch.equal(conv[3], after_step[0]) and torch.equal(ssm[3], after_step[1])
    else:
        window = torch.cat((conv_before[1], conv_inputs[1:1 + accepted].T), dim=-1)[:, -(WIDTH - 1):]
        assert torch.equal(conv[3], window)
        replayed = ssm_before[1:2].clone()
        rows = slice(1, 1 + accepted)
        gated_delta_recurrent_ref(*(x[rows] for x in delta_inputs), torch.tensor([0, accepted]), replayed,
                                  torch.tensor([0]))
        assert torch.equal(ssm[3], replayed[0])
    assert cache.seqs["v"].num_tokens == 10 + accepted + 1 and cache.seqs["v"].verify is None
