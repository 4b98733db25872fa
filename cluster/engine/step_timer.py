"""How long the coordinator sleeps before it reads a step's result from a Ray Compiled Graph.

A compiled graph returns a step's result through a shared-memory channel, and Ray reads that
channel by busy-waiting (its mutable-object read loop yields and retries). While rank 0 computes a
10-20 ms CPU decode step, the coordinator's reader would spin on a core of its own: on a 2-core
machine that is the core the rank's second matmul thread needs (measured on SmolLM2 TP=1: the
coordinator process used 21 ms of CPU per generated token, as much as the rank). So the
coordinator first sleeps through most of the step's expected compute time, then reads.

The expectation is per step shape: steps with the same number of scheduled requests and tokens of
the same power of two cost about the same. It follows the measured time down at once and up
slowly, and only ``SLEEP_FRACTION`` of it is slept, so a step that runs faster than the last ones
costs at most a fraction of a millisecond of latency; a shape never seen is not slept on.
"""

from __future__ import annotations

from shardserve.workers.messages import StepPlan

SLEEP_FRACTION = 0.8    # of the expected compute time
_RISE = 0.2             # weight of a slower measurement in the expectation


class StepTimer:
    """Expected rank compute time (seconds) per step shape, from rank 0's ``execute_s``."""

    def __init__(self) -> None:
        self._expected: dict[tuple[int, int], float] = {}

    @staticmethod
    def _shape(plan: StepPlan) -> tuple[int, int]:
        tokens = sum(len(req.token_ids) for req in plan.scheduled)
        return len(plan.scheduled), tokens.bit_length()

    def sleep_s(self, plan: StepPlan) -> float:
        """Seconds to sleep before reading ``plan``'s result (0 for a shape not seen yet)."""
        return SLEEP_FRACTION * self._expected.get(self._shape(plan), 0.0)

    def observe(self, plan: StepPlan, execute_s: float) -> None:
        """Record that ``plan`` took ``execute_s`` seconds of compute on rank 0."""
        shape = self._shape(plan)
        expected = self._expected.get(shape)
        if expected is None or execute_s < expected:
            self._expected[shape] = execute_s
        else:
            self._expected[shape] = expected + _RISE * (execute_s - expected)
