"""The engine of a replica with data-parallel attention (CPU only, no model): per-group block pools
and schedulers, placement of new requests, one plan per group per step, results routed back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardserve.cluster.engine.dp_engine import MTP_REFUSAL, DataParallelEngine
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.engine.scheduler import SchedulerConfig
from shardserve.workers.messages import DataParallelResult, SampledToken, StepResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, 128)
    return AutoTokenizer.from_pretrained(str(path))


def make_engine(tokenizer, num_blocks: int = 16) -> DataParallelEngine:
    return DataParallelEngine(None, tokenizer, num_blocks, 4, SchedulerConfig(8, 64, 64), set(), 128, True,
                              num_groups=2)


def run_step(engine: DataParallelEngine, token: int = 5) -> list:
    """Schedule every group and answer each sampling request with ``token`` (as the ranks would)."""
    batch = engine.schedule()
    results = [StepResult([SampledToken(s.req_id, token) for s in b.plan.scheduled if s.sample])
               for b in batch.batches]
    return engine.update(batch, DataParallelResult(results))


def test_placement_steps_and_pooled_views(tokenizer):
    engine = make_engine(tokenizer)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefix = list(range(10, 26))                                 # 16 tokens: 4 full blocks
    assert engine.add_request(prefix + [40], greedy, "a") == "a"   # group 0 (tie: lowest index)
    engine.add_request([50, 51, 52], greedy, "b")                # group 1: fewer unfinished
    assert engine.group_of == {"a": 0, "b": 1}
    batch = engine.schedule()
    assert [[s.req_id for s in b.plan.scheduled] for b in batch.batches] == [["a"], ["b"]]
    assert batch.plan.token_counts == [17, 3]
    outputs = engine.update(batch, DataParallelResult([StepResult([SampledToken("a", 7)]),
                                                       StepResult([SampledToken("b", 8)])]))
    assert {(o.request_id, tuple(o.new_token_ids)) for o in outputs} == {("a", (7,)), ("b", (8,))}
    assert engine.scheduler.num_unfinished == 2 and len(engine.scheduler.running) == 2
    assert engine.block_manager.num_blocks == 32                 # the replica's pool: both groups
    assert engine.block_manager.num_free_blocks == 32 - 5 - 1
    while engine.has_unfinished():
        run_step(engine)
    assert engine.group_of == {} and engine.block_manager.num_free_blocks == 32
    # group 1 is now busier, but group 0 holds the prompt's prefix: the hit wins
    engine.add_request([60, 61], greedy, "c")                    # group 0 (tie)
    engine.add_request([62, 63], greedy, "d")                    # group 1
    engine.add_request([64, 65], greedy, "e")                    # group 0 (tie)
    assert engine.add_request(prefix + [41, 42], greedy, "f") and engine.group_of["f"] == 0
    engine.add_request([70], greedy, "g")                        # group 1: no hit, least loaded
    assert engine.num_placed == [4, 3] and engine.group_of["g"] == 1
    engine.abort("f")
    assert "f" not in engine.group_of and "f" not in engine.requests
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], greedy, "c")


def test_idle_group_gets_an_empty_plan_and_mtp_is_refused(tokenizer):
    engine = make_engine(tokenizer)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "only")
    batch = engine.schedule()
    assert batch.plan.token_counts == [3, 0] and not batch.plan.plans[1].scheduled
    (out,) = engine.update(batch, DataParallelResult([StepResult([SampledToken("only", 9)]), StepResult()]))
    assert out.finished and out.new_token_ids == [9]
    with pytest.raises(ValueError, match="speculative-tokens"):
        DataParallelEngine(None, tokenizer, 8, 4, SchedulerConfig(8, 64, 64), set(), 128, num_groups=2,
                           speculator=object())
    assert "attention group" in MTP_REFUSAL
