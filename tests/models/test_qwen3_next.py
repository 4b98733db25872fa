"""Qwen3-Next (gated DeltaNet + gated attention + MoE) against transformers' ``Qwen3NextForCausalLM``
(float32, eager) on a tiny random checkpoint: prefill logits and 16 greedy steps for prompts of 2,
20 and 150 tokens (the long one over several 64-token prefill chunks, batched with the others'
decodes) on one rank and on two gloo ranks with an even and an uneven (3 + 1) split; after a
speculative verify with a rejected draft every rank resumes from the accepted token's state."""

from __future__ import annotations

import pytest
import torch
from procs import free_port, run_ranks

from plan_driver import make_runner
from qwen3_next_script import prompts, run_script, transformers_logits, verify_with_rejection
from shardserve.workers.comm_cpu import GlooGroup
from shardserve.workers.distributed import set_tp_group

TOLERANCE = 1e-4
SPLITS = {"even": [1.0, 1.0], "uneven": [3.0, 1.0]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (two only add OpenMP fork/join cost on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def oracle(qwen3_next):
    """``check(results, label)``: asserts each prompt's tokens are transformers' greedy choices and
    its logits match transformers' within :data:`TOLERANCE`."""
    cache: dict[tuple, torch.Tensor] = {}

    def check(results: dict[str, tuple[list[int], torch.Tensor]], label: str) -> None:
        for name, prompt in prompts().items():
            tokens, logits = results[name]
            key = (name, tuple(tokens))
            if key not in cache:
                cache[key] = transformers_logits(qwen3_next.hf, prompt, tokens)
            expected = cache[key]
            diff = (logits - expected).abs().max().item()
            print(f"{label} {name}: max |ours - transformers| = {diff:.2e}")
            assert diff < TOLERANCE, f"{label} {name}: logits differ by {diff}"
            assert tokens == expected.argmax(-1).tolist(), f"{label} {name}: not transformers' greedy tokens"

    return check


def check_rollback(results, resumed: torch.Tensor, label: str) -> None:
    """``resumed`` (logits after a rejected draft) equals the plain run's logits at that position."""
    diff = (resumed - results["p20"][1][3]).abs().max().item()
    assert diff < TOLERANCE, f"{label}: after a rejected draft the logits differ by {diff}"


def test_single_rank_matches_transformers(qwen3_next, oracle):
    runner = make_runner(qwen3_next.path, block_size=4, num_blocks=96)
    results = run_script(runner)
    oracle(results, "TP=1")
    assert len(runner.model.state_layers()) == 4 and len(runner.model.attention_layers()) == 2
    fresh = make_runner(qwen3_next.path, block_size=4, num_blocks=8)
    check_rollback(results, verify_with_rejection(fresh, results["p20"][0]), "TP=1")


def _worker(rank: int, world_size: int, port: int, path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    group = GlooGroup(rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        set_tp_group(group)
        results = {}
        for label, split in SPLITS.items():
            runner = make_runner(path, block_size=4, num_blocks=96, tensor_split=split)
            deltanet, attention = runner.model.state_layers()[0], runner.model.attention_layers()[0]
            moe = runner.model.model.layers[1].mlp
            layout = (deltanet.num_k_heads, deltanet.kv_cache[1].shape[1], attention.num_kv_heads, moe.experts.count)
            script = run_script(runner)
            fresh = make_runner(path, block_size=4, num_blocks=8, tensor_split=split)
            results[label] = (script, layout, verify_with_rejection(fresh, script["p20"][0]))
        torch.save(results, f"{out_path}.{rank}")
    finally:
        group.close()


def test_tp2_even_and_uneven_match_transformers(qwen3_next, oracle, tmp_path):
    out_path = tmp_path / "tp2.pt"
    run_ranks(_worker, (2, free_port(), str(qwen3_next.path), str(out_path)), nprocs=2, timeout_s=240)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    # (key heads, state value heads, KV heads, routed experts) per rank: the slots are sharded with the heads
    assert [r["even"][1] for r in ranks] == [(2, 4, 2, 4), (2, 4, 2, 4)]
    assert [r["uneven"][1] for r in ranks] == [(3, 6, 3, 6), (1, 2, 1, 2)]
    for label in SPLITS:
        for name in prompts():
            assert torch.equal(ranks[0][label][0][name][1], ranks[1][label][0][name][1]), f"{label}: ranks disagree"
        oracle(ranks[0][label][0], f"TP=2 {label}")
        assert torch.equal(ranks[0][label][2], ranks[1][label][2])
        check_rollback(ranks[0][label][0], ranks[0][label][2], f"TP=2 {label}")
