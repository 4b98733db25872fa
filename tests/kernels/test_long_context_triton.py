"""Long prompts on the Triton kernels (interpreted) of issue 25: the indexer's row-chunk scoring,
the sparse (top-k) absorbed prefill and the expanded dense prefill run in Triton while the rest of
the model stays on torch (the interpreter is slow; ``test_model_kernels.py`` covers the other
kernels). Same oracle as ``tests/models/test_long_context.py``: transformers' greedy tokens, with a
prefix-cache hit."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from long_prompts import greedy_matches_transformers, prompts, record_prefill_forms  # noqa: E402
from test_model_kernels import count_calls  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

# Modules whose dispatch is forced to Triton, and the launcher each must reach.
TRITON_MODULES = {"indexer": ("indexer_triton", "score_rows_triton"),
                  "mla_attention": ("mla_attention_triton", "mla_attention_triton"),
                  "mla_prefill": ("mla_prefill_triton", "attend_chunk_triton")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch) -> (path, transformers model)``: the tiny checkpoint with a tokenizer, once."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            cache[arch] = path, write_tiny_checkpoint(arch, path, seed=0, tokenizer=True)
        return cache[arch]

    return get


def force_triton(monkeypatch) -> Counter:
    """Route the long-context ops to Triton and count their launcher calls."""
    for module in TRITON_MODULES:
        monkeypatch.setattr(importlib.import_module(f"shardserve.kernels.{module}"), "use_triton", lambda _: True)
    return count_calls(monkeypatch, list(TRITON_MODULES.values()))


# The interpreter is slow: one case per architecture. V3.2 in 32-token steps (sparse chunks over a
# growing context), GLM-5 in one step (sparse, IndexShare), V3 in one step (expanded, then absorbed).
@pytest.mark.parametrize("arch,step_tokens", [("deepseek_v32", 32), ("glm_moe_dsa", 4096), ("deepseek_v3", 4096)],
                         ids=["deepseek_v32-32-token-steps", "glm_moe_dsa-one-shot", "deepseek_v3-one-shot"])
def test_long_prompt_on_triton_equals_transformers(checkpoint, arch, step_tokens, monkeypatch):
    path, hf = checkpoint(arch)
    first, second = prompts(72, 48, 64)
    forms = record_prefill_forms(monkeypatch)
    calls = force_triton(monkeypatch)
    greedy_matches_transformers(path, hf, step_tokens, first, second, 48, max_tokens=2)
    if arch == "deepseek_v3":
        expected = {"attend_chunk_triton"} if step_tokens > 54 else set()
        assert set(forms) == ({"expanded", "absorbed"} if step_tokens > 54 else {"absorbed"}), forms
        assert {"mla_attention_triton"} | expected <= set(calls), calls
    else:
        assert set(forms) == {"sparse"}, forms
        assert {"score_rows_triton", "mla_attention_triton"} <= set(calls), calls
