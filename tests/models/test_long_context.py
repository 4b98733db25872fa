"""Long prompts on MLA / DSA (issue 25): greedy equality with transformers where every prefill
chunk selects (top-k 8 far below the context), and prefill memory linear in the context.

The Triton (interpreted) twin of the parity test is ``tests/kernels/test_long_context_triton.py``;
TP=2 is covered by ``test_deepseek_tp.py`` (its third sequence is a 92-token prompt).
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from long_prompts import engine_copy, greedy_matches_transformers, prompts, record_prefill_forms
from tiny_checkpoints import write_tiny_checkpoint
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.llm import LLM
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS

ARCHS = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3")


@pytest.mark.parametrize("step_tokens", [32, 4096], ids=["32-token-steps", "one-shot"])
@pytest.mark.parametrize("arch", ARCHS)
def test_long_prompt_greedy_equals_transformers(tiny_model, arch, step_tokens, tmp_path, monkeypatch):
    """120- and 104-token prompts (64 shared, served from the prefix cache): DSA prefill is sparse in
    every chunk; V3 expands a chunk of 54 tokens or more per key chunk and absorbs shorter ones."""
    tiny = tiny_model(arch)
    path = engine_copy(tiny.path, tmp_path / arch)
    first, second = prompts(120, 64, 104)
    forms = record_prefill_forms(monkeypatch)
    greedy_matches_transformers(path, tiny.hf, step_tokens, first, second, 64, max_tokens=6)
    if arch == "deepseek_v3":
        # One step: the 120-token prompt expanded, the second prompt's 40 uncached tokens absorbed.
        assert set(forms) == ({"expanded", "absorbed"} if step_tokens > 54 else {"absorbed"}), forms
    else:
        assert set(forms) == {"sparse"}, forms


def _memory(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _peak_rss_of(run) -> int:
    """Bytes the process's resident set grew by at its peak while ``run()`` ran (the kernel's
    high-water mark is reset first: ``/proc/self/clear_refs``)."""
    base = _memory("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    run()
    return _memory("VmHWM") - base


def linear_bound(context: int, step_tokens: int, config) -> int:
    """What a prefill step may allocate, from the shapes: the bounded workspaces (the indexer's chunk
    logits + causal mask + two score tiles, 7 bytes per workspace element, then the attention's
    tiles, never both alive), activations per step token (hidden states, MLA queries and outputs,
    indexer queries, a few alive at once, float32), per context position the step's int64 bookkeeping
    (positions, slots, block table) with headroom, and 64 MiB for the allocator's and Python's
    slack. Nothing ``tokens x context``."""
    per_token = 4 * 8 * (config.hidden_size + config.num_attention_heads * (config.kv_lora_rank + 64)
                         + config.index_n_heads * config.index_head_dim + config.intermediate_size)
    return 7 * WORKSPACE_ELEMENTS + step_tokens * per_token + context * 64 + (64 << 20)


@pytest.mark.slow
def test_32k_prompt_prefill_memory_is_linear_in_the_context(tmp_path):
    """A tiny DeepSeek-V3.2 with a 65,536-position RoPE table prefills a 32,768-token prompt (2,048-
    token steps, top-k 8): the forward's peak stays within a bound computed from the shapes and
    linear in the context (the old dense path peaked at 3.55 GiB here: [B, H, Q, S] scores), and
    grows from an 8,192-token prompt (whose steps already fill the workspaces) by no more than the
    bound's per-position term."""
    path = tmp_path / "v32-64k"
    # One layer and a one-head, 16-dim indexer: the indexer's O(context^2) scoring stays cheap on CPU.
    hf = write_tiny_checkpoint("deepseek_v32", path, seed=0, num_hidden_layers=1, max_position_embeddings=65536,
                               index_n_heads=1, index_head_dim=16, qk_rope_head_dim=8, tokenizer=True)
    llm = LLM(EngineArgs(model=str(path), block_size=16, num_blocks=32768 // 16 + 8, max_num_batched_tokens=2048),
              progress=False)
    assert llm.runner.model.model.layers[0].self_attn.rotary.cos.shape[0] == 65536
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    peaks = {}
    for context in (8192, 32768):
        prompt = torch.randint(2, 128, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        peaks[context] = _peak_rss_of(lambda: llm.generate([prompt], params))
        bound = linear_bound(context, 2048, hf.config)
        print(f"context {context}: peak +{peaks[context] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
        assert peaks[context] <= bound, f"{context} tokens: peak {peaks[context]} > bound {bound}"
    assert peaks[32768] - peaks[8192] <= (32768 - 8192) * 64 + (64 << 20)
    shutil.rmtree(path)
