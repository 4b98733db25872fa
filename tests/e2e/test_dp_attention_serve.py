"""``shardserve serve --enable-dp-attention`` end to end (issue 29): HTTP completions from a TP=2
replica whose two ranks are separate attention groups equal transformers' greedy tokens (both
``--moe-a2a`` modes, concurrent requests), and ``/metrics`` and ModelInfo report twice one group's
KV capacity. Needs the DP-attention flags (``cluster/dp_attention_args.py``); skipped without them.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from serve_process import ServeProcess, http, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import tiny_token_text, write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.extended]
NUM_TOKENS = 8
PROMPTS = [list(range(10, 30)), list(range(40, 45)), list(range(60, 71)), list(range(90, 97))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp-serve") / "ckpt"
    hf = write_tiny_checkpoint("deepseek_v32", path, seed=0, tokenizer=True)
    expected = []
    for ids in PROMPTS:   # the tokenizer puts BOS (token 0) first
        with torch.no_grad():
            out = hf.generate(torch.tensor([[0] + ids]), max_new_tokens=NUM_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(ids) + 1:].tolist())
    return path, expected


@pytest.mark.parametrize("mode", ["allgather", "alltoall"])
def test_serve_dp_attention_matches_transformers(folder, tmp_path, mode):
    path, expected = folder
    server = ServeProcess(str(path), ["-tp", "2", "--enable-dp-attention", "--moe-a2a", mode, "--kv-cache-gib",
                                      "0.01", "--max-model-len", "128", "--device", "cpu"], tmp_path / "stderr.log")
    try:
        def complete(ids):
            status, body = http(server.base + "/v1/completions", {
                "prompt": " ".join(tiny_token_text(i) for i in ids), "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert status == 200, body
            return body["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        # the text leaves out special tokens (BOS 0, EOS 1: ignore_eos keeps generating past EOS)
        assert [text.split() for text in texts] == [[tiny_token_text(i) for i in ids if i > 1] for ids in expected]
        info = server.model_info()
        assert info.attention_dp_size == 2 and info.kv_capacity_tokens == info.num_blocks * info.block_size
        # the router's gauges follow its periodic ModelInfo poll: wait for the first one
        gauges = wait_for("the KV capacity gauge", lambda: [
            line for line in server.metrics().splitlines()
            if line.startswith("shardserve_kv_cache_capacity_tokens{") and not line.endswith(" 0.0")], 60)
        assert len(gauges) == 1 and float(gauges[0].split()[-1]) == info.kv_capacity_tokens, gauges
    finally:
        server.stop()
