"""Whole models on the Triton kernels (interpreted on CPU) give the torch path's greedy tokens:
a tiny Llama written by transformers and tiny DeepSeek-V3, V3.2, GLM-5 and Qwen3-Next checkpoints, a batch of
two sequences (one prefilled in two chunks across a block boundary) then greedy decode. Every
Triton entry point the model should use is counted, so a model that silently falls back to torch
fails."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from plan_driver import PlanDriver, make_runner  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint, write_tiny_llama  # noqa: E402


# Triton entry points each architecture must call: (module in kernels/, function).
COMMON = [("norm_triton", "rms_norm_triton"), ("rotary_triton", "apply_rotary_triton"),
          ("activation_triton", "silu_and_mul_triton")]
EXPECTED = {
    "llama": COMMON + [("paged_attention_triton", "store_kv_triton"),
                       ("paged_attention_triton", "paged_attention_triton")],
    "deepseek_v32": COMMON + [("paged_attention_triton", "store_cache_triton"),
                              ("mla_attention_triton", "mla_attention_triton"),
                              ("indexer_triton", "score_rows_triton"),
                              ("hadamard_triton", "hadamard_transform_triton"),
                              ("fused_moe_triton", "fused_moe_triton")],
}
EXPECTED["glm_moe_dsa"] = EXPECTED["deepseek_v32"]
EXPECTED["qwen3_next"] = EXPECTED["llama"] + [("fused_moe_triton", "fused_moe_triton"),
                                              ("causal_conv1d_triton", "causal_conv1d_triton"),
                                              ("gated_delta_triton", "gated_delta_chunk_triton"),
                                              ("gated_delta_triton", "gated_delta_recurrent_triton")]
# Fewer layers where the interpreter is slow: one DeltaNet (dense MLP) and one attention (MoE) layer.
OVERRIDES = {"qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                mlp_only_layers=[])}
EXPECTED["deepseek_v3"] = [entry for entry in EXPECTED["deepseek_v32"]              # no DSA indexer
                           if entry[0] not in ("indexer_triton", "hadamard_triton")]


def count_calls(monkeypatch, entry_points) -> Counter:
    """Wrap each ``kernels.<module>.<function>`` so that its calls are counted by name."""
    calls: Counter = Counter()
    for module_name, name in entry_points:
        module = importlib.import_module(f"shardserve.kernels.{module_name}")
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def greedy_run(path: Path, steps: int = 4, **switches) -> tuple[dict, torch.Tensor]:
    runner = make_runner(path, block_size=16, num_blocks=16, **switches)
    driver = PlanDriver(runner, seed=1)
    long_prompt = list(range(3, 20))                     # 17 tokens: one past a block boundary
    first = driver.step({"a": long_prompt[:9], "b": [5, 7, 9]})
    first.update(driver.step({"a": long_prompt[9:]}))    # second chunk of a's prefill
    tokens, logits = driver.greedy(first, steps)
    return tokens, torch.cat([logits["a"], logits["b"]])


@pytest.mark.parametrize("arch,switches", [("llama", {}), ("deepseek_v3", {}), ("deepseek_v32", {}),
                                           ("glm_moe_dsa", {}), ("deepseek_v32", {"indexer_cache_dtype": "fp8"}),
                                           ("qwen3_next", {})],
                         ids=["llama", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v32-fp8-indexer-cache",
                              "qwen3_next"])
def test_triton_kernels_give_the_torch_tokens(arch, switches, tmp_path, monkeypatch):
    if arch == "llama":
        write_tiny_llama(tmp_path)
    else:
        write_tiny_checkpoint(arch, tmp_path, seed=0, **OVERRIDES.get(arch, {}))
    monkeypatch.setenv("SHARDSERVE_KERNELS", "torch")
    torch_tokens, torch_logits = greedy_run(tmp_path, **switches)
    calls = count_calls(monkeypatch, EXPECTED[arch])
    monkeypatch.setenv("SHARDSERVE_KERNELS", "triton")
    triton_tokens, triton_logits = greedy_run(tmp_path, **switches)
    assert not [name for _, name in EXPECTED[arch] if calls[name] == 0], calls
    assert triton_tokens == torch_tokens
    torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
