"""``--dsa-sink``: the first positions of each sequence always stay in that sequence's DSA top-k.

The checkpoints are tiny DeepSeek-V3.2 / GLM-5 models whose indexers are hand-set so that token 0
(which starts every prompt here) scores lowest at every layer (``crafted_indexer.py``): without the
sink, position 0 is dropped from every query that sees more than ``index_topk`` keys; with it,
every such query keeps its own sequence's position 0. ik_llama.cpp's first port applied the boost
to the batch's first cells, which protects only the first sequence of a packed batch; here three
sequences of different lengths share one step and each must equal itself run alone.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from crafted_indexer import craft_marker_checkpoint
from plan_driver import PlanDriver, hf_logits, make_runner
from tiny_checkpoints import load_hf_model, write_tiny_tokenizer
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams

DSA_ARCHS = ["deepseek_v32", "glm_moe_dsa"]
TOP_K = 8                                     # the tiny configs' index_topk


@pytest.fixture(scope="module")
def sink_model(tiny_model, tmp_path_factory):
    """``sink_model(arch) -> (path, transformers model)``: the tiny checkpoint with token 0 scoring
    lowest and never emitted, and the word-level tokenizer (the engine tests need one)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = shutil.copytree(tiny_model(arch).path, tmp_path_factory.mktemp(arch) / "sink")
            craft_marker_checkpoint(path, marker_ids=set(range(1, 128)), never_emit={0})
            write_tiny_tokenizer(path, 128)
            cache[arch] = path, load_hf_model(path)
        return cache[arch]

    return get


def _prompt(length: int, seed: int) -> list[int]:
    return [0] + torch.randint(2, 128, (length - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


class TopkRecorder:
    """Keeps every selection the indexers of ``layers`` return (``[T, k]`` int32 or None)."""

    def __init__(self, layers, monkeypatch) -> None:
        self.rows: list[torch.Tensor] = []
        for layer in layers:
            if layer.indexer is not None:
                inner = layer.indexer.forward
                monkeypatch.setattr(layer.indexer, "forward", self._wrap(inner))

    def _wrap(self, inner):
        def forward(*args, **kwargs):
            topk = inner(*args, **kwargs)
            if topk is not None:
                self.rows.append(topk)
            return topk
        return forward

    def every_row_keeps_position_0(self) -> bool:
        """Each row holds position 0 (a row that sees fewer than k keys holds them all)."""
        return bool(self.rows) and all(bool((rows == 0).any(-1).all()) for rows in self.rows)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_crafted_indexer_drops_position_0_without_the_sink(sink_model, arch):
    """Sink 0 (the default) is today's behaviour: logits equal transformers', and every query
    with more than k keys leaves position 0 out (the crafting works)."""
    path, hf = sink_model(arch)
    prompt = _prompt(20, seed=1)
    runner = make_runner(path)
    layers = [layer for layer in runner.model.attention_layers() if layer.indexer is not None]
    for layer in layers:
        layer.record_topk = True
    driver = PlanDriver(runner)
    prefill = driver.step_all_rows({"a": prompt})["a"]
    assert all(not (layer.last_topk[TOP_K:] == 0).any() for layer in layers)
    generated, decode = driver.greedy({"a": prefill[-1]}, 8)
    reference = hf_logits(hf, prompt + generated["a"][:-1])
    assert (torch.cat((prefill, decode["a"])) - reference).abs().max().item() < 1e-4


def _run(path, work_steps: list[dict[str, list[int]]], sink: int, recorder_patch=None):
    """Run the given steps (all rows' logits) on a fresh runner; returns per-request logits rows."""
    runner = make_runner(path, dsa_sink=sink)
    recorder = TopkRecorder(runner.model.attention_layers(), recorder_patch) if recorder_patch else None
    driver, out = PlanDriver(runner, seed=len(work_steps[0])), {}
    for work in work_steps:
        for req, logits in driver.step_all_rows(work).items():
            out.setdefault(req, []).append(logits)
    return {req: torch.cat(rows) for req, rows in out.items()}, recorder


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_three_packed_sequences_each_keep_their_own_position_0(sink_model, arch, monkeypatch):
    """3 sequences (13, 21, 30 tokens) prefilled in one step, then 3 decode steps together: with
    ``--dsa-sink 1`` every selection row holds position 0 of its own sequence, and each sequence's
    logits equal the sequence run alone (and differ from sink 0: the sink took effect)."""
    path, _ = sink_model(arch)
    prompts = {"a": _prompt(13, 1), "b": _prompt(21, 2), "c": _prompt(30, 3)}
    decode = {req: [[5 + i], [40 + i], [77 + i]] for i, req in enumerate(prompts)}
    steps = [prompts] + [{req: decode[req][j] for req in prompts} for j in range(3)]
    packed, recorder = _run(path, steps, sink=1, recorder_patch=monkeypatch)
    assert recorder.every_row_keeps_position_0()
    assert sum(rows.shape[0] for rows in recorder.rows) > 3 * TOP_K
    plain, _ = _run(path, steps, sink=0)
    for req, prompt in prompts.items():
        alone, _ = _run(path, [{req: prompt}] + [{req: decode[req][j]} for j in range(3)], sink=1)
        assert (packed[req] - alone[req]).abs().max().item() < 1e-4, req
        assert (packed[req] - plain[req]).abs().max().item() > 1e-2, f"{req}: the sink changed nothing"


def _engine(path, **overrides) -> LLM:
    args = dict(model=str(path), block_size=4, num_blocks=128, dsa_sink=1)
    return LLM(EngineArgs(**{**args, **overrides}), progress=False)


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_sink_survives_chunked_prefill_and_a_prefix_cache_hit(sink_model, arch, monkeypatch):
    """A 40-token prompt prefilled in 16-token steps, then a second prompt whose first 32 tokens
    come from the prefix cache: every selection keeps position 0 and the tokens equal one-shot
    prefill without the prefix cache."""
    path, _ = sink_model(arch)
    first, second = _prompt(40, 4), _prompt(40, 4)[:32] + _prompt(9, 5)[1:]
    oneshot = _engine(path, enable_prefix_caching=False)
    expected = [done.token_ids for done in oneshot.generate([first, second], GREEDY)]

    llm = _engine(path, max_num_batched_tokens=16)
    recorder = TopkRecorder(llm.runner.model.attention_layers(), monkeypatch)
    assert llm.generate([first], GREEDY)[0].token_ids == expected[0]
    assert recorder.every_row_keeps_position_0() and max(r.shape[0] for r in recorder.rows) == 16
    recorder.rows.clear()
    hits_before = llm.core.block_manager.prefix_hits
    assert llm.generate([second], GREEDY)[0].token_ids == expected[1]
    assert llm.core.block_manager.prefix_hits - hits_before == 32
    assert recorder.rows[0].shape[0] == len(second) - 32          # only the uncached tail was computed
    assert recorder.every_row_keeps_position_0()


def test_sink_larger_than_top_k_is_rejected(sink_model):
    path, _ = sink_model("deepseek_v32")
    with pytest.raises(ValueError, match="dsa-sink"):
        EngineArgs(model=str(path), dsa_top_k=4, dsa_sink=5).validate()
    with pytest.raises(ValueError, match="dsa-sink"):
        make_runner(path, dsa_sink=TOP_K + 1)
