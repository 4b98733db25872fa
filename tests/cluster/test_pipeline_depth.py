"""Async scheduling's depth: a step is sent ahead only while steps are short (issue 30)."""

from __future__ import annotations

from shardserve.cluster.replica.coordinator import PIPELINE_MAX_STEP_S, pipeline_depth


def test_step_sent_ahead_only_while_steps_are_short():
    assert pipeline_depth(True, 0.0) == 2                       # first step: nothing measured yet
    assert pipeline_depth(True, 0.03) == 2                      # a 1-client CPU decode step
    assert pipeline_depth(True, PIPELINE_MAX_STEP_S) == 1
    assert pipeline_depth(True, 0.6) == 1                       # a 32-client step with prefills
    assert pipeline_depth(False, 0.0) == 1                      # MTP drafting or compiled-graph dispatch
