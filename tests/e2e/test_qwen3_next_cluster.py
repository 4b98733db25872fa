"""A Qwen3-Next HF folder (tiny random checkpoint with SmolLM2's tokenizer) through the
``shardserve generate`` console script and through a tensor-parallel replica on a real Ray
cluster (the coordinator ``serve-grpc`` and ``serve`` run), uneven split 3 + 1: the same tokens
and logits as the single-process engine, every block and state slot back in the pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog because it"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_files):
    from shardserve.cluster.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("qwen3_next_hf")
    tokenizer = load_tokenizer(smollm2_files)
    write_tiny_checkpoint("qwen3_next", path, seed=1, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def single(folder):
    return LLM(EngineArgs(model=str(folder), kv_cache_gib=0.02, max_num_seqs=8), progress=False)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_cli_generate_on_a_checkpoint_folder(folder, single):
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", str(folder), "--prompt", PROMPT, "--max-tokens",
                           str(NUM_TOKENS), "--temperature", "0", "--kv-cache-gib", "0.02", "--max-num-seqs", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prefix caching is off" in proc.stderr and "recurrent-state pool" in proc.stderr
    (done,) = single.generate([PROMPT], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    assert proc.stdout == done.text + "\n"


@pytest.mark.ray
def test_tensor_parallel_cluster_matches_single_process(folder, single, ray_cluster, replicas):
    prompts = [single.encode(PROMPT), single.encode("Hello"), single.encode(PROMPT + " and then" * 30)]
    expected = [d.token_ids for d in single.generate(prompts, greedy())]
    handle = replicas.launch(EngineArgs(model=str(folder), tensor_parallel_size=2, tensor_split=[3.0, 1.0],
                                        kv_cache_gib=0.02, max_num_seqs=8, max_num_batched_tokens=32),
                             GroupConfig(cpus_per_worker=1))
    try:
        done = ray_cluster.get([handle.complete.remote(p, greedy()) for p in prompts])
        assert [d["token_ids"] for d in done] == expected
        diff = (ray_cluster.get(handle.prompt_logits.remote(prompts[2])) - single.core.prompt_logits(prompts[2]))
        assert diff.abs().max().item() < 1e-4
        info = ray_cluster.get(handle.model_info.remote())
        assert info["num_free_blocks"] == info["num_blocks"]
    finally:
        replicas.stop(handle)
