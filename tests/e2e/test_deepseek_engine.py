"""DeepSeek-V3.2 / GLM-5 checkpoints through the whole engine, the CLI and the Ray cluster: tiny
random checkpoints written by transformers with a real tokenizer (SmolLM2's) saved beside them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog because it"  # > index_topk (8) tokens: DSA bites
NUM_TOKENS = 12


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory, smollm2_files):
    from shardserve.cluster.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp(request.param)
    tokenizer = load_tokenizer(smollm2_files)
    write_tiny_checkpoint(request.param, folder, seed=1, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(folder))
    return request.param, folder


def hf_greedy(folder, prompt_ids, **config_overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32,
                                                 **config_overrides).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NUM_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def greedy():
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_engine_greedy_equals_transformers_and_dsa_switches(checkpoint):
    arch, folder = checkpoint
    llm = LLM(EngineArgs(model=str(folder), kv_cache_gib=0.01), progress=False)
    prompt_ids = llm.encode(PROMPT)
    assert len(prompt_ids) > llm.hf_config.index_topk
    (done,) = llm.generate([PROMPT], greedy())
    assert done.token_ids == hf_greedy(folder, prompt_ids)
    # --dsa-top-k 4 equals transformers with index_topk=4; --no-dsa equals the dense reference
    # (transformers with an indexer that keeps every key).
    small = LLM(EngineArgs(model=str(folder), kv_cache_gib=0.01, dsa_top_k=4), progress=False)
    assert small.generate([PROMPT], greedy())[0].token_ids == hf_greedy(folder, prompt_ids, index_topk=4)
    dense = LLM(EngineArgs(model=str(folder), kv_cache_gib=0.01, dsa=False), progress=False)
    assert dense.generate([PROMPT], greedy())[0].token_ids == hf_greedy(folder, prompt_ids, index_topk=4096)


def test_cli_generate_on_a_checkpoint_folder(checkpoint):
    arch, folder = checkpoint
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", str(folder), "--prompt", PROMPT, "--max-tokens",
                           str(NUM_TOKENS), "--temperature", "0", "--dsa-top-k", "4", "--indexer-cache-dtype", "fp8",
                           "--kv-cache-gib", "0.01"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    llm = LLM(EngineArgs(model=str(folder), kv_cache_gib=0.01, dsa_top_k=4, indexer_cache_dtype="fp8"), progress=False)
    indexers = [layer.indexer for layer in llm.runner.model.attention_layers() if layer.indexer is not None]
    assert indexers and all(indexer.k_cache.dtype == torch.uint8 for indexer in indexers)
    (done,) = llm.generate([PROMPT], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    assert proc.stdout == done.text + "\n"


@pytest.mark.ray
def test_tensor_parallel_cluster_matches_single_process(checkpoint, ray_cluster, replicas):
    arch, folder = checkpoint
    llm = LLM(EngineArgs(model=str(folder), kv_cache_gib=0.01), progress=False)
    prompts = [llm.encode(PROMPT), llm.encode("Hello"), llm.encode(PROMPT + " and then" * 4)]
    expected = [d.token_ids for d in llm.generate(prompts, greedy())]
    handle = replicas.launch(EngineArgs(model=str(folder), tensor_parallel_size=2, tensor_split=[3.0, 1.0],
                                        kv_cache_gib=0.01), GroupConfig(cpus_per_worker=1))
    try:
        done = ray_cluster.get([handle.complete.remote(p, greedy()) for p in prompts])
        assert [d["token_ids"] for d in done] == expected
        diff = (ray_cluster.get(handle.prompt_logits.remote(prompts[2])) - llm.core.prompt_logits(prompts[2]))
        assert diff.abs().max().item() < 1e-4
        assert_same_plans(ray_cluster.get(handle.memory_plans.remote()), folder, "--tensor-parallel-size", "2",
                          "--tensor-split", "3,1", "--device", "cpu", "--kv-cache-gib", "0.01")
    finally:
        replicas.stop(handle)


def assert_same_plans(logged: list[str], folder, *argv) -> None:
    """Every rank's start-up plan equals what ``shardserve plan`` prints for the same arguments (the
    host memory available, CPU ranks' capacity, moves between the two and is left out)."""
    import contextlib
    import io
    import json
    import re

    from shardserve.cluster.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", str(folder), *argv, "--json"])
    printed = [rank["summary"] for rank in json.loads(out.getvalue())["ranks"]]
    usable = re.compile(r"\(cpu, [0-9.]+ [GM]iB usable of [0-9.]+ [GM]iB\)")
    assert [usable.sub("", line) for line in logged] == [usable.sub("", line) for line in printed]
