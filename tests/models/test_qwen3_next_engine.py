"""Qwen3-Next in the single-process engine: batching, chunked prefill, state-slot reuse, prefix
caching, preemption and speculative decoding never change greedy output, and every block and
state slot goes back to the pool. The expected tokens are the runner-level workload's, which
``test_qwen3_next.py`` checks against transformers."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from plan_driver import make_runner
from qwen3_next_script import NUM_STEPS, prompts, run_script
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from shardserve.workers.messages import (DraftBatch, DraftProposal, DraftResult, NewRequestData, SamplingOptions,
                                         ScheduledRequest, StepPlan)

GREEDY = SamplingParams(max_tokens=1 + NUM_STEPS, temperature=0, ignore_eos=True)
VOCAB = 128


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (two only add OpenMP fork/join cost on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_llm(path, drafter=None, **overrides) -> LLM:
    args = dict(model=str(path), block_size=4, num_blocks=128, max_num_batched_tokens=2048, max_num_seqs=8)
    return LLM(EngineArgs(**{**args, **overrides}), progress=False, drafter=drafter)


@pytest.fixture(scope="module")
def expected(qwen3_next) -> dict[tuple, list[int]]:
    """Prompt -> its greedy tokens (the parity-tested runner workload)."""
    results = run_script(make_runner(qwen3_next.path, block_size=4, num_blocks=96))
    return {tuple(prompt): results[name][0] for name, prompt in prompts().items()}


def assert_pool_empty(llm: LLM) -> None:
    bm, slots = llm.core.block_manager, llm.core.scheduler.state_slots
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_free_blocks} of {bm.num_blocks} blocks free"
    assert slots.num_free == slots.num_slots, f"{slots.num_free} of {slots.num_slots} state slots free"


def test_batch_and_chunked_prefill_equal_each_alone(qwen3_next, expected):
    """Three different-length prompts in one batch under a 16-token step budget (the 150-token prompt
    in 16-token chunks beside the others' decodes) give what each gives alone in one-shot prefill."""
    batch = list(expected)
    one_shot = make_llm(qwen3_next.path)
    alone = [one_shot.generate([list(p)], GREEDY)[0].token_ids for p in batch]
    assert alone == [expected[p] for p in batch]
    chunked = make_llm(qwen3_next.path, max_num_batched_tokens=16)
    assert [d.token_ids for d in chunked.generate([list(p) for p in batch], GREEDY)] == alone
    assert_pool_empty(one_shot)
    assert_pool_empty(chunked)


def test_reused_slot_equals_fresh_engine(qwen3_next, expected):
    """A finished request's slot, still holding its final state, serves the next request as a fresh
    engine would (logits, not only tokens): the slot is zeroed when it is handed out again."""
    long_prompt, short_prompt = (list(p) for p in expected if len(p) in (150, 20))
    llm = make_llm(qwen3_next.path, max_num_seqs=1)
    llm.generate([long_prompt], GREEDY)
    (seq,) = llm.runner.state_cache.seqs.values()
    assert any(t[seq.slot].abs().sum() > 0 for layer in llm.runner.state_layers for t in layer.kv_cache)
    plan, probe = llm.core.probe_plan(short_prompt)
    try:
        assert probe.state_slot == seq.slot, "the probe should reuse the finished request's slot"
        reused = llm.runner.execute(plan).logits[0]
    finally:
        llm.core.release_probe(probe)
    fresh = make_llm(qwen3_next.path, max_num_seqs=1).core.prompt_logits(short_prompt)
    assert torch.equal(reused, fresh)
    (again,) = llm.generate([short_prompt], GREEDY)
    assert again.token_ids == expected[tuple(short_prompt)]
    assert_pool_empty(llm)


def test_prefix_caching_is_off_and_preemption_recomputes(qwen3_next, expected, caplog):
    """Prefix caching is turned off for the hybrid model (a cached prefix has no recurrent state),
    with a log line; asking for it or not gives the same output. A pool too small for the batch
    preempts (freeing the slot) and recomputes without changing the output."""
    batch = [list(p) for p in expected]
    shared = [batch[2][:100] + batch[1], batch[2]]   # a 100-token common prefix
    with caplog.at_level(logging.INFO, logger="shardserve.cluster.engine.engine"):
        cached = make_llm(qwen3_next.path, enable_prefix_caching=True)
    assert "prefix caching is off" in caplog.text and not cached.core.block_manager.enable_prefix_caching
    uncached = make_llm(qwen3_next.path, enable_prefix_caching=False)
    outputs = [llm.generate(shared, GREEDY) for llm in (cached, uncached)]
    assert [d.token_ids for d in outputs[0]] == [d.token_ids for d in outputs[1]]
    assert outputs[0][1].token_ids == expected[tuple(batch[2])]
    # 44 blocks of 4 tokens: the three requests need 5 + 9 + 42 at the end
    tiny_pool = make_llm(qwen3_next.path, num_blocks=44, max_num_batched_tokens=32)
    assert [d.token_ids for d in tiny_pool.generate(batch, GREEDY)] == [expected[tuple(p)] for p in batch]
    assert tiny_pool.core.scheduler.num_preemptions > 0
    assert_pool_empty(tiny_pool)


class OracleDrafter:
    """The engine's draft hook, proposing the known greedy continuation with a wrong token wherever
    ``wrong(output_index)`` (so drafts are accepted up to chosen points)."""

    def __init__(self, truth: dict[tuple, list[int]], wrong) -> None:
        self.truth, self.wrong, self.llm = truth, wrong, None

    def propose(self, batch: DraftBatch) -> DraftResult:
        proposals = []
        for sched in batch.scheduled:
            if not sched.num_drafts:
                continue
            request = self.llm.core.requests[sched.req_id].request
            truth = self.truth[tuple(request.prompt_token_ids)]
            start = request.num_output_tokens
            tokens = [truth[start + j] if start + j < len(truth) else 0 for j in range(sched.num_drafts)]
            tokens = [(t + 1) % VOCAB if self.wrong(start + j) else t for j, t in enumerate(tokens)]
            proposals.append(DraftProposal(sched.req_id, tokens))
        return DraftResult(proposals)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_greedy_equals_plain_decoding(qwen3_next, expected, k):
    """Drafts from the engine's draft hook, right up to chosen points: every accepted run length and
    rollbacks to each of them, in a batch whose 16-token budget also drops drafts."""
    drafter = OracleDrafter(expected, wrong=lambda index: index % 3 == 1)
    llm = make_llm(qwen3_next.path, drafter, speculative_tokens=k, max_num_batched_tokens=16)
    drafter.llm = llm
    batch = [list(p) for p in expected]
    assert [d.token_ids for d in llm.generate(batch, GREEDY)] == [expected[tuple(p)] for p in batch]
    stats = llm.core.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_pool_empty(llm)


def test_always_wrong_drafts_change_nothing(qwen3_next, expected):
    drafter = OracleDrafter(expected, wrong=lambda index: True)
    llm = make_llm(qwen3_next.path, drafter, speculative_tokens=3)
    drafter.llm = llm
    batch = [list(p) for p in expected]
    assert [d.token_ids for d in llm.generate(batch, GREEDY)] == [expected[tuple(p)] for p in batch]
    stats = llm.core.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0


def test_rejected_drafts_leave_the_state_of_plain_decoding(qwen3_next):
    """Runner level: after a verify step whose two drafts are rejected, the next step's logits and
    every layer's conv window and matrix state equal plain decoding's."""
    prompt = prompts()["p20"]
    runners = {mode: make_runner(qwen3_next.path, block_size=4, num_blocks=16) for mode in ("plain", "spec")}
    new = [NewRequestData("r", SamplingOptions(temperature=0), 3)]
    logits, states = {}, {}
    for mode, runner in runners.items():
        first = runner.execute(StepPlan(new, [ScheduledRequest("r", prompt, 0, list(range(7)), True, 0)]))
        token = first.sampled[0].token_id
        drafts = [(token + 1) % VOCAB, (token + 2) % VOCAB] if mode == "spec" else []
        second = runner.execute(StepPlan([], [ScheduledRequest("r", [token, *drafts], 20, [], True, 1,
                                                               num_spec_tokens=len(drafts))]))
        assert len(second.sampled) == 1, "the wrong drafts must be rejected"
        result = runner.execute(StepPlan([], [ScheduledRequest("r", [second.sampled[0].token_id], 21, [], True, 2)],
                                         return_logits=True))
        logits[mode] = result.logits
        states[mode] = [t[3].clone() for layer in runner.state_layers for t in layer.kv_cache]
    diff = (logits["spec"] - logits["plain"]).abs().max().item()
    state_diff = max((a - b).abs().max().item() for a, b in zip(states["spec"], states["plain"]))
    print(f"after a rejected verify: max |logits diff| {diff:.2e}, max |state diff| {state_diff:.2e}")
    assert diff < 1e-5 and state_diff < 1e-5


def test_reload_of_a_changed_recurrent_weight_resets_the_state_pool(qwen3_next, expected, tmp_path):
    """A weight reload on the hybrid model: exactly the changed tensor is swapped, the recurrent-state
    pool is zeroed with no slot owned, and greedy output equals a fresh load of the changed files."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(qwen3_next.path, folder)
    llm = make_llm(folder)
    batch = [list(p) for p in expected]
    assert [d.token_ids for d in llm.generate(batch, GREEDY)] == [expected[tuple(p)] for p in batch]
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(str(file))
    name = "model.layers.0.linear_attn.A_log"
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(file), metadata={"format": "pt"})
    result = llm.reload_weights()
    assert (result.changed_tensors, result.weights_version) == (1, 2)
    assert not llm.runner.state_cache.seqs
    assert all(t.abs().sum() == 0 for layer in llm.runner.state_layers for t in layer.kv_cache)
    reloaded = [d.token_ids for d in llm.generate(batch, GREEDY)]
    assert reloaded == [d.token_ids for d in make_llm(folder).generate(batch, GREEDY)]
    assert reloaded != [expected[tuple(p)] for p in batch], "the change must show in the output"
    assert_pool_empty(llm)
