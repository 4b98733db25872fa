"""Long prompts on MLA / DSA (issue 25): greedy equality with transformers where every prefill
chunk selects (top-k 8 far below the context), and prefill memory linear in the context.

The Triton (interpreted) twin of the parity test is ``tests/kernels/test_long_context_triton.py``;
TP=2 is covered by ``test_deepseek_tp.py`` (its third sequence is a 92-token prompt).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from long_prompts import engine_copy, greedy_matches_transformers, prompts, record_prefill_forms
from tiny_checkpoints import write_tiny_checkpoint
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.llm import LLM
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS
from shardserve.workers.activation import StepShape, step_activation_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from alloc_tracker import StorageTracker  # noqa: E402

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


def linear_bound(context: int, step_tokens: int, config) -> int:
    """What a prefill step may allocate, from the shapes alone: the bounded workspaces (the indexer's
    chunk logits + causal mask + two score tiles, 7 bytes per workspace element; the attention's
    tiles come after, never beside them), float32 activations per step token (hidden states, MLA
    queries and outputs, indexer queries; at most 8 alive at once), and per context position the
    step's int64 bookkeeping (positions, slots, block table) with headroom. Nothing ``tokens x
    context``."""
    per_token = 4 * 8 * (config.hidden_size + config.num_attention_heads * (config.kv_lora_rank + 64)
                         + config.index_n_heads * config.index_head_dim + config.intermediate_size)
    return 7 * WORKSPACE_ELEMENTS + step_tokens * per_token + context * 64


@pytest.mark.slow
def test_32k_prompt_prefill_memory_is_linear_in_the_context(tmp_path):
    """A tiny DeepSeek-V3.2 with a 65,536-position RoPE table prefills a 32,768-token prompt (2,048-
    token steps, top-k 8). The bytes of the storages torch creates during the whole generate call
    (``tests/workers/alloc_tracker.py``: CPU has no allocator statistics) peak within a bound
    computed from the shapes and linear in the context (the old dense path: 3.55 GiB of process
    peak here, [B, H, Q, S] scores), within the plan's activation reserve for the step, and no
    higher than after an 8,192-token prompt (whose steps already fill the workspaces) plus the
    bound's per-position term."""
    path = tmp_path / "v32-64k"
    # One layer and a one-head, 16-dim indexer: the indexer's O(context^2) scoring stays cheap on CPU.
    hf = write_tiny_checkpoint("deepseek_v32", path, seed=0, num_hidden_layers=1, max_position_embeddings=65536,
                               index_n_heads=1, index_head_dim=16, qk_rope_head_dim=8, tokenizer=True)
    llm = LLM(EngineArgs(model=str(path), block_size=16, num_blocks=32768 // 16 + 8, max_num_batched_tokens=2048,
                         max_prefill_tokens=2048), progress=False)   # not CPU ranks' default 128 per step
    assert llm.runner.model.model.layers[0].self_attn.rotary.cos.shape[0] == 65536
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    peaks = {}
    for context in (8192, 32768):
        prompt = torch.randint(2, 128, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        with StorageTracker() as tracker:
            llm.generate([prompt], params)
        peaks[context] = tracker.peak
        bound = linear_bound(context, 2048, hf.config)
        reserve = step_activation_bytes(llm.runner.model, StepShape.prefill(2048, context, 64), triton=False,
                                        block_size=16)
        print(f"context {context}: peak {tracker.peak / 2**20:.0f} MiB, reserve {reserve / 2**20:.0f} MiB, "
              f"bound {bound / 2**20:.0f} MiB")
        assert tracker.peak <= reserve <= bound, (context, tracker.peak, reserve, bound)
    assert peaks[32768] <= peaks[8192] + (32768 - 8192) * 64
    shutil.rmtree(path)


def test_plan_reserves_as_much_kv_at_163840_tokens_as_at_4096(tmp_path, capsys):
    """``shardserve plan`` of DeepSeek-V3.2 (FP8, TP=8 on 141 GiB GPUs, from its config.json): the
    activation reserve (the same function the profile is bounded by) grows by less than 1 MiB from
    a 4,096- to a 163,840-token context, and the KV budget stays within 0.1% (the dense-masked
    prefill's reserve was 14.2 GB at 32,768 tokens and 69.2 GB at 163,840: it did not fit)."""
    from transformers import DeepseekV32Config

    from shardserve.cluster.cli import main

    config = DeepseekV32Config()
    config.architectures = ["DeepseekV32ForCausalLM"]
    config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    config.save_pretrained(tmp_path)
    ranks = {}
    for context in (4096, 163840):
        assert main(["plan", str(tmp_path), "-tp", "8", "--gpu-memory-gib", "141", "--max-model-len", str(context),
                     "--json"]) == 0
        ranks[context] = json.loads(capsys.readouterr().out)["ranks"][0]
    short, long = ranks[4096], ranks[163840]
    assert 0 <= long["activation_bytes"] - short["activation_bytes"] < 2**20, (short, long)
    assert long["kv_budget_bytes"] >= 0.999 * short["kv_budget_bytes"]
    assert long["kv_tokens"] >= 163840 * 3
