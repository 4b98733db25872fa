"""The trained demo model (``benchmarks/train_demo.py``) on a short run of a few steps: transformers
and shardserve give the same greedy tokens on it (speculative decoding with its MTP layer too), the
checkpoint holds the MTP layer in DeepSeek's layout, training is deterministic for a seed, and the
name ``shakespeare-dsa-mtp`` resolves to the cache folder or says how to train it.

The greedy comparison stays within the top-k (64 keys), where the indexer keeps every key: after a
few warm-up steps the indexer's scores are near-ties that float summation order decides, so a
DSA-active comparison would test rounding. ``bench_demo.py`` compares with DSA active on the fully
trained model; ``test_deepseek_engine.py`` does on random checkpoints with well-spread scores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.llm import LLM
from shardserve.cluster.engine.request import SamplingParams
from shardserve.workers.model_source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import train_demo  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "shakespeare-dsa-mtp"
TOP_K = 64
# A few steps of each stage on short sequences: minutes become seconds, every code path still runs.
# The corpus: the first 60 kB of tinyshakespeare (public domain), in the repository so a clean
# clone trains without ../shared/data.
DATA = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare_head.txt"
QUICK = ["--data", str(DATA), "--dense-steps", "3", "--long-steps", "1", "--warmup-steps", "2",
         "--sparse-steps", "2", "--distill-steps", "2",
         "--seq-len", "64", "--batch-size", "2", "--long-len", "96", "--long-batch-size", "1",
         "--sparse-len", "80", "--sparse-batch-size", "1", "--top-k", str(TOP_K), "--threads", "1"]
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A shardserve cache folder holding a quickly trained demo model."""
    folder = tmp_path_factory.mktemp("cache")
    train_demo.main(QUICK + ["--seed", "1", "--out", str(folder / NAME)])
    return folder


def test_transformers_and_shardserve_give_the_same_greedy_tokens(cache):
    from transformers import AutoModelForCausalLM

    path = cache / NAME
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()
    llm = LLM(EngineArgs(model=str(path), kv_cache_gib=0.02), progress=False)
    prompt_ids = llm.encode(PROMPT)
    assert 16 < len(prompt_ids) <= TOP_K - 16
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt_ids):].tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert llm.generate([prompt_ids], params)[0].token_ids == expected
    spec = LLM(EngineArgs(model=str(path), kv_cache_gib=0.02, speculative_tokens=2), progress=False)
    assert spec.generate([prompt_ids], params)[0].token_ids == expected
    assert spec.core.speculator.stats.num_draft_tokens > 0


def test_checkpoint_layout(cache):
    path = cache / NAME
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV32ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["index_topk"] == TOP_K and 1900 <= config["vocab_size"] <= 2048
    names = set(load_file(str(path / "model.safetensors")))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    for sub in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                "embed_tokens.weight", "self_attn.indexer.wk.weight", "mlp.experts.0.gate_proj.weight",
                "mlp.shared_experts.down_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert mtp + sub in names, sub
    summary = json.loads((path / "training_summary.json").read_text())
    assert summary["seed"] == 1 and summary["schedule"]["sparse_steps"] == 2


def test_training_is_deterministic(cache, tmp_path):
    again = train_demo.main(QUICK + ["--seed", "1", "--out", str(tmp_path / NAME)])
    first, second = load_file(str(cache / NAME / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_known_name_resolves_to_the_cache_or_says_how_to_train(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(cache))
    assert resolve_model(NAME).path == cache / NAME
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="benchmarks/train_demo.py"):
        resolve_model(NAME)
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", NAME, "--prompt", "hi"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SHARDSERVE_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and "python benchmarks/train_demo.py" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
