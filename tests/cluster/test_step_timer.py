"""The coordinator's sleep before reading a compiled-graph step result (cluster/engine/step_timer.py)."""

import pytest

from shardserve.cluster.engine.step_timer import SLEEP_FRACTION, StepTimer
from shardserve.workers.messages import ScheduledRequest, StepPlan


def plan(*lengths: int) -> StepPlan:
    return StepPlan(scheduled=[ScheduledRequest(f"r{i}", [1] * n, 0, [], True, 0) for i, n in enumerate(lengths)])


def test_a_shape_never_seen_is_not_slept_on_and_a_seen_one_sleeps_a_fraction_of_its_time():
    timer = StepTimer()
    assert timer.sleep_s(plan(1)) == 0.0
    timer.observe(plan(1), 0.010)
    assert timer.sleep_s(plan(1)) == pytest.approx(SLEEP_FRACTION * 0.010)
    assert timer.sleep_s(plan(1, 1)) == 0.0           # two decode rows: another shape
    assert timer.sleep_s(plan(300)) == 0.0            # a prefill chunk: another shape
    timer.observe(plan(300), 0.2)
    assert timer.sleep_s(plan(400)) == pytest.approx(SLEEP_FRACTION * 0.2)   # same power of two of tokens


def test_the_expectation_follows_faster_steps_at_once_and_slower_ones_slowly():
    timer = StepTimer()
    timer.observe(plan(1), 0.010)
    timer.observe(plan(1), 0.004)                      # faster: taken at once
    assert timer.sleep_s(plan(1)) == pytest.approx(SLEEP_FRACTION * 0.004)
    timer.observe(plan(1), 0.104)                      # one slow step (e.g. the machine was busy)
    assert SLEEP_FRACTION * 0.004 < timer.sleep_s(plan(1)) < SLEEP_FRACTION * 0.030
