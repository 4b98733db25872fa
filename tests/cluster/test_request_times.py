"""Where a request's time goes inside the engine (vLLM's ``vllm:request_*_time_seconds``, issue 30
item 3): queue, prefill and decode time on its final output, on SmolLM2 with one sequence at a
time, so the second request waits in the queue for the whole life of the first."""

from __future__ import annotations

import time

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.llm import LLM
from shardserve.cluster.replica.grpc_server import _response


def test_a_queued_request_reports_the_time_it_waited_and_its_phases_add_up(smollm2_files):
    llm = LLM(EngineArgs(model=str(smollm2_files.path), kv_cache_gib=0.05, max_num_seqs=1), progress=False)
    core = llm.core
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    started = time.monotonic()
    first, second = (core.add_request(list(range(20 + i, 60 + i)), params) for i in range(2))
    finals, partial = {}, []
    while core.has_unfinished():
        for out in core.step():
            (finals.__setitem__(out.request_id, out) if out.finished else partial.append(out))
    wall = time.monotonic() - started
    assert partial and all(out.times is None for out in partial)        # only a final output carries them
    a, b = finals[first].times, finals[second].times
    for times in (a, b):
        assert times.queue_s >= 0 and times.prefill_s > 0 and times.decode_s > 0
        assert times.inference_s == times.prefill_s + times.decode_s
        assert times.queue_s + times.inference_s <= wall
    assert b.queue_s >= a.inference_s          # the second was scheduled only once the first had ended
    assert a.queue_s < b.queue_s
    message = _response(finals[second]).times   # what the replica sends the router
    assert (message.queue_s, message.prefill_s, message.decode_s) == (b.queue_s, b.prefill_s, b.decode_s)
