"""Async scheduling's send-ahead rule (``Coordinator._may_send_ahead``): only while steps are short
(issue 30: a request arriving during a long step waited for the step sent ahead too), and with an
adaptive speculator only after a step that neither verifies drafts nor feeds a draft pass (issue 31)."""

from __future__ import annotations

from types import SimpleNamespace

from shardserve.cluster.replica.coordinator import PIPELINE_MAX_STEP_S, Coordinator


def may_send_ahead(last_execute_s: float, in_flight=(), speculator=None, pipelined: bool = True) -> bool:
    replica = SimpleNamespace(_pipelined=pipelined, _last_execute_s=last_execute_s,
                              core=SimpleNamespace(speculator=speculator))
    return Coordinator._may_send_ahead(replica, list(in_flight))


def step(return_hidden: bool = False, num_spec_tokens: int = 0) -> list:
    plan = SimpleNamespace(return_hidden=return_hidden, scheduled=[SimpleNamespace(num_spec_tokens=num_spec_tokens)])
    return [SimpleNamespace(plan=plan), None, 0.0]


def test_step_sent_ahead_only_while_steps_are_short():
    assert may_send_ahead(0.0)                                  # first step: nothing measured yet
    assert may_send_ahead(0.03)                                 # a 1-client CPU decode step
    assert not may_send_ahead(PIPELINE_MAX_STEP_S)
    assert not may_send_ahead(0.6)                              # a 32-client step with prefills
    assert not may_send_ahead(0.0, pipelined=False)             # compiled-graph dispatch, fixed MTP


def test_a_cold_adaptive_speculator_is_pipelined_but_not_after_a_draft_step():
    adaptive = object()
    assert may_send_ahead(0.01, [step()], adaptive)
    assert not may_send_ahead(0.01, [step(return_hidden=True)], adaptive)   # its hidden states feed a draft pass
    assert not may_send_ahead(0.01, [step(num_spec_tokens=2)], adaptive)    # acceptance decides the next positions
