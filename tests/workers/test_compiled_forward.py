"""``--compile``: the torch.compile'd forward against the eager one and transformers, its compile
count over steps of every shape, and its on-disk cache across start-ups (tiny Llama, float32).

The compiled engine shares one cache folder (``$SHARDSERVE_CACHE``) for the module: the fixture
compiles cold, a second build (in this process after Dynamo's reset; slow: in a second process)
must only load from it. Fast apart from the one cold compile of a two-layer model.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

from tiny_checkpoints import write_tiny_llama  # noqa: E402

from shardserve.cluster.config import EngineArgs  # noqa: E402
from shardserve.cluster.engine.request import SamplingParams  # noqa: E402
from shardserve.cluster.llm import LLM  # noqa: E402
from shardserve.workers.compilation import CompiledForward, compile_stats, use_compile  # noqa: E402

THREADS = 1
ENGINE_ARGS = dict(dtype="float32", num_blocks=64, block_size=4, max_num_seqs=8)
PROMPTS = [[0, 5, 9, 17, 33, 2], [0, 44], [0] + list(range(3, 40)), [0, 7, 7, 7, 8]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(checkpoint folder, transformers model, shared compile cache folder)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = write_tiny_llama(path, tokenizer=True)
    return path, hf, tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def engines(llama):
    """The eager and the compiled single-process engine on the tiny Llama (float32), built on
    ``THREADS`` threads: Inductor's C++ kernels specialize on the thread count, which is part of
    the cache key, so every build in this module (and the second process) uses the same count."""
    path, _, cache = llama
    old = {name: os.environ.get(name) for name in ("SHARDSERVE_CACHE", "TORCHINDUCTOR_CACHE_DIR")}
    threads = torch.get_num_threads()
    os.environ["SHARDSERVE_CACHE"] = str(cache)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    torch.set_num_threads(THREADS)
    torch._dynamo.reset()
    try:
        args = dict(model=str(path), **ENGINE_ARGS)
        eager = LLM(EngineArgs(**args), progress=False)
        before = compile_stats()
        compiled = LLM(EngineArgs(**args, compile="on"), progress=False)
        yield eager, compiled, before
    finally:
        torch.set_num_threads(threads)
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_auto_compiles_cpu_ranks_only():
    assert use_compile("auto", torch.device("cpu")) and not use_compile("auto", torch.device("cuda"))
    assert use_compile("on", torch.device("cuda")) and not use_compile("off", torch.device("cpu"))
    with pytest.raises(ValueError, match="--compile"):
        use_compile("max", torch.device("cpu"))
    with pytest.raises(ValueError, match="--compile"):
        EngineArgs(compile="yes").validate()


def test_compiled_logits_and_greedy_tokens_match_eager_and_transformers(engines, llama):
    eager, compiled, _ = engines
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    for ids in PROMPTS:
        diff = (compiled.core.prompt_logits(ids) - eager.core.prompt_logits(ids)).abs().max().item()
        assert diff < 1e-4, f"prompt {ids[:4]}...: compiled vs eager logits differ by {diff}"
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ours = [c.token_ids for c in compiled.generate(PROMPTS, params)]
    assert ours == [c.token_ids for c in eager.generate(PROMPTS, params)]
    hf = llama[1]
    with torch.no_grad():
        for ids, tokens in zip(PROMPTS, ours):
            prompt = torch.tensor([ids])   # explicit mask: token 0 is also the pad id, generate would mask it
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            assert out[0, len(ids):].tolist() == tokens


def test_fifty_steps_of_every_batch_size_compile_once(engines):
    _, compiled, before = engines
    after_start = compile_stats()
    assert after_start["traces"] - before["traces"] == 1, "start-up traces the forward exactly once"
    core = compiled.core
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    steps, sizes = 0, set()
    for wave in range(6):   # requests join and finish at different steps: decode batches 1..8, mixed steps
        for i in range(wave % 4 + 1):
            core.add_request(PROMPTS[(wave + i) % len(PROMPTS)][: 2 + wave + i], params)
        for _ in range(3 + wave):
            batch = core.schedule()
            if not batch.plan.scheduled:
                break
            sizes.add(sum(len(s.token_ids) for s in batch.plan.scheduled))
            core.update(batch, core.executor.execute(batch.plan))
            steps += 1
    while core.has_unfinished() and steps < 50:
        core.step()
        steps += 1
    while steps < 50:
        core.add_request(PROMPTS[steps % len(PROMPTS)], SamplingParams(max_tokens=1, temperature=0))
        core.step()
        steps += 1
    assert len(sizes) >= 5, f"token counts seen: {sorted(sizes)}"
    assert compile_stats() == after_start, "a step recompiled the forward"


def rebuild_compiled(path, caplog) -> tuple[LLM, dict, dict]:
    """A new compiled engine on the tiny Llama after Dynamo's in-memory state is dropped, the
    compilation log captured: ``(engine, compile_stats() before, after)``."""
    torch._dynamo.reset()
    before = compile_stats()
    with caplog.at_level(logging.INFO, logger="shardserve.workers.compilation"):
        again = LLM(EngineArgs(model=str(path), **ENGINE_ARGS, compile="on"), progress=False)
    return again, before, compile_stats()


def assert_same_logits(engine: LLM, eager: LLM) -> None:
    for ids in PROMPTS[:2]:
        assert (engine.core.prompt_logits(ids) - eager.core.prompt_logits(ids)).abs().max().item() < 1e-4


def test_second_build_loads_the_compiled_forward_from_the_disk_cache(engines, llama, caplog):
    """A new engine after Dynamo's in-memory state is dropped loads the saved compiled forward: no
    trace, no kernel build (new module objects: the forward takes the model as an argument). Runs
    after the tests that use the module's compiled engine."""
    path, _, _ = llama
    eager = engines[0]
    again, before, after = rebuild_compiled(path, caplog)
    assert after["loads"] == before["loads"] + 1 and after["traces"] == before["traces"], (before, after)
    assert after["cache_misses"] == before["cache_misses"], after
    assert "(loaded from the compile cache)" in caplog.text
    assert_same_logits(again, eager)


def test_a_compiled_forward_that_does_not_load_is_compiled_again_and_replaced(engines, llama, caplog):
    """A truncated file in the cache (a full disk, a killed writer): a warning, a fresh compile
    (kernels from Inductor's cache), the file rewritten, the same logits."""
    path, _, cache = llama
    eager = engines[0]
    saved = list((cache / "inductor").glob("forward-*.bin"))
    assert len(saved) == 1, saved
    saved[0].write_bytes(saved[0].read_bytes()[:1000])
    again, before, after = rebuild_compiled(path, caplog)
    assert "does not load" in caplog.text and after["traces"] == before["traces"] + 1, caplog.text
    assert after["loads"] == before["loads"] and saved[0].stat().st_size > 1000
    assert_same_logits(again, eager)


@pytest.mark.slow
def test_second_start_up_reads_the_compile_cache(engines, llama):
    """The same across processes: a second ``generate`` start-up logs no kernel build."""
    path, _, cache = llama
    env = dict(os.environ, SHARDSERVE_CACHE=str(cache), OMP_NUM_THREADS=str(THREADS))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-m", "shardserve.cluster.cli", "generate", "--model", str(path), "--prompt", "w003 w004",
                          "--max-tokens", "4", "--temperature", "0", "--dtype", "float32", "--compile", "on",
                          "--kv-cache-gib", "0.01"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiled forward" in out.stderr and "loaded from the compile cache" in out.stderr, out.stderr[-2000:]
    assert "generated and built" not in out.stderr


class _Toy(torch.nn.Module):
    """``forward(input_ids [T], positions [T]) -> [T, width]``: an embedding and a linear layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(input_ids)) + positions[:, None]


@torch.inference_mode()
def test_two_models_of_one_class_and_other_shapes_compile_apart():
    """Without guards, a second model of the same class in the same process (another engine, a
    swapped-in model) must not run the first one's graph: each compiled forward has its own."""
    ids, positions = torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0, 2.0])
    for width in (8, 12):
        toy = _Toy(width)
        compiled = CompiledForward(toy)
        torch.testing.assert_close(compiled(ids, positions), toy(ids, positions))
        torch.testing.assert_close(compiled(ids[:1], positions[:1]), toy(ids[:1], positions[:1]))


def test_a_compile_cache_that_cannot_be_written_leaves_a_working_compiled_forward(engines, llama, tmp_path,
                                                                                   monkeypatch, caplog):
    """``$SHARDSERVE_CACHE/inductor`` not a folder (as a read-only volume: nothing can be made
    there): a warning, Inductor works in a temporary folder, the forward is compiled and right
    (it failed at start-up: Inductor could not make its cache folder)."""
    path, _, _ = llama
    eager = engines[0]
    (tmp_path / "inductor").write_text("not a folder")
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    again, _, _ = rebuild_compiled(path, caplog)
    assert "cannot be written" in caplog.text and "not saved" in caplog.text, caplog.text
    assert not os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
    assert_same_logits(again, eager)
