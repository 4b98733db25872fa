"""Whole models on the Triton kernels (interpreted on CPU) give the torch path's greedy tokens:
a tiny Llama written by transformers and a tiny DeepSeek-V3.2 checkpoint, a batch of two
sequences (one prefilled in two chunks across a block boundary) then greedy decode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402


def write_tiny_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(str(path))


def greedy_run(path: Path, steps: int = 4) -> tuple[dict, torch.Tensor]:
    runner = make_runner(path, block_size=16, num_blocks=16)
    driver = PlanDriver(runner, seed=1)
    long_prompt = list(range(3, 20))                     # 17 tokens: one past a block boundary
    first = driver.step({"a": long_prompt[:9], "b": [5, 7, 9]})
    first.update(driver.step({"a": long_prompt[9:]}))    # second chunk of a's prefill
    tokens, logits = driver.greedy(first, steps)
    return tokens, torch.cat([logits["a"], logits["b"]])


@pytest.mark.parametrize("arch", ["llama", "deepseek_v32"])
def test_triton_kernels_give_the_torch_tokens(arch, tmp_path, monkeypatch):
    if arch == "llama":
        write_tiny_llama(tmp_path)
    else:
        write_tiny_checkpoint(arch, tmp_path, seed=0)
    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")
    torch_tokens, torch_logits = greedy_run(tmp_path)
    monkeypatch.setenv("SHARDSERVE_KERNELS", "triton")
    triton_tokens, triton_logits = greedy_run(tmp_path)
    assert triton_tokens == torch_tokens
    torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
