"""``--compile`` on every model family: the compiled forward's logits equal the eager forward's
(float32, so within float rounding), at TP=1 and at TP=2 over gloo with uneven splits.

Each run is two sequences (one prefilled in two chunks) followed by greedy decode steps, so
prefill, decode, DSA selection and IndexShare, MoE routing, the gated-DeltaNet states and the
all-reduces all run through the compiled graph and its opaque calls. Slow: Inductor builds C++
kernels for five models (and again in each TP rank).
"""

from __future__ import annotations


import pytest
import torch
from procs import free_port, run_ranks

from plan_driver import PlanDriver, make_runner
from tiny_checkpoints import write_tiny_llama
from shardserve.workers.comm_cpu import GlooGroup
from shardserve.workers.compilation import compile_stats
from shardserve.workers.distributed import set_tp_group

SPLITS = {"llama": [2.0, 1.0], "deepseek_v3": [1.0, 3.0], "deepseek_v32": [3.0, 1.0], "glm_moe_dsa": [1.0, 1.0],
          "qwen3_next": [3.0, 1.0]}
TIMEOUT_S = 1200   # a cold Inductor build of one family took ~10 min on a loaded 2-core machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 300)]   # over the suite's 600 s default
# make test compiles one MLA family (MLA, DSA, MoE: ~15 s); every family and TP=2 are extended. The
# MLA families failed here unnoticed while only extended runs compiled them.
IN_MAKE_TEST = ("deepseek_v32",)


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory) -> dict[str, str]:
    """Every family's tiny checkpoint; the Llama one with 3 KV groups, so TP=2 can split it 2 + 1."""
    llama = tmp_path_factory.mktemp("llama")
    write_tiny_llama(llama, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    return {arch: str(llama if arch == "llama" else tiny_model(arch).path) for arch in SPLITS}


@pytest.fixture(autouse=True)
def compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)


def run_script(runner) -> torch.Tensor:
    """Sequence x (11 tokens in chunks of 5 + 6) and y (3 tokens), then 5 greedy decode steps of both.

    Returns:
        ``[num_steps * 2, vocab]`` last-token logits of every step and request.
    """
    gen = torch.Generator().manual_seed(0)
    prompt = [0] + torch.randint(2, 60, (10,), generator=gen).tolist()
    driver = PlanDriver(runner, seed=3)
    first = driver.step({"x": prompt[:5], "y": [0, 9, 2]})
    rows = [first["x"], first["y"]]
    last = {"x": prompt[5:], "y": [int(first["y"].argmax())]}
    for _ in range(6):
        out = driver.step(last)
        rows += [out["x"], out["y"]]
        last = {req: [int(logits.argmax())] for req, logits in out.items()}
    return torch.stack(rows)


def _rank(rank: int, world_size: int, port: int, jobs: list[tuple[str, str]], out_path: str) -> None:
    torch.set_num_threads(1)
    group = GlooGroup(rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        set_tp_group(group)
        logits = {arch: run_script(make_runner(path, tensor_split=SPLITS[arch], compile="on")) for arch, path in jobs}
        torch.save({"logits": logits, "stats": compile_stats()}, f"{out_path}.{rank}")
    finally:
        group.close()


@pytest.mark.parametrize("arch", [arch if arch in IN_MAKE_TEST else pytest.param(arch, marks=pytest.mark.extended)
                                  for arch in SPLITS])
def test_tp1_compiled_equals_eager(checkpoints, arch):
    path = checkpoints[arch]
    eager = run_script(make_runner(path))
    before = compile_stats()
    runner = make_runner(path, compile="on")
    assert runner.compiled is not None
    compiled = run_script(runner)
    after = compile_stats()
    assert after["traces"] - before["traces"] == 1, "traced once, at start-up; no step recompiled"
    assert after["loads"] == before["loads"], "a fresh cache folder: nothing to load"
    diff = (compiled - eager).abs().max().item()
    assert diff < 1e-4 * max(1.0, eager.abs().max().item()), f"{arch}: max |compiled - eager| = {diff}"


@pytest.mark.extended
def test_tp2_compiled_equals_tp1_eager(checkpoints, tmp_path):
    jobs = list(checkpoints.items())
    out_path = tmp_path / "tp2.pt"
    run_ranks(_rank, (2, free_port(), jobs, str(out_path)), nprocs=2, timeout_s=TIMEOUT_S)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    for rank in ranks:
        assert rank["stats"]["traces"] == len(jobs), f"one trace per model, none per step: {rank['stats']}"
    for arch, path in jobs:
        assert torch.equal(ranks[0]["logits"][arch], ranks[1]["logits"][arch]), f"{arch}: ranks disagree"
        eager = run_script(make_runner(path))
        diff = (ranks[0]["logits"][arch] - eager).abs().max().item()
        assert diff < 1e-4 * max(1.0, eager.abs().max().item()), f"{arch} split {SPLITS[arch]}: max diff {diff}"
