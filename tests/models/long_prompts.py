"""Shared by the long-prompt parity tests (torch path here, Triton path in ``tests/kernels``).

A prompt many times longer than the tiny checkpoints' ``index_topk`` (8) goes through the
single-process engine in 32-token steps or in one step, then a second prompt whose first tokens
come from the prefix cache; transformers (teacher forcing, no cache) must pick every generated
token. Which prefill form each MLA layer used is recorded, so a test also shows that every DSA
prefill chunk selected (none fell back to dense) and which dense form V3 took.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import torch

from plan_driver import hf_logits
from tiny_checkpoints import write_tiny_tokenizer
from shardserve.cluster.config import EngineArgs
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.llm import LLM
from shardserve.workers.models.mla import MLAAttention


def engine_copy(path: Path, dest: Path) -> Path:
    """A copy of a tiny checkpoint with the word-level tokenizer the engine needs."""
    copy = shutil.copytree(path, dest)
    write_tiny_tokenizer(copy, 128)
    return Path(copy)


def prompts(first_len: int, shared: int, second_len: int) -> tuple[list[int], list[int]]:
    """A prompt and a second one sharing its first ``shared`` tokens (a prefix-cache hit)."""
    gen = torch.Generator().manual_seed(first_len)
    first = torch.randint(2, 128, (first_len,), generator=gen).tolist()
    return first, first[:shared] + torch.randint(2, 128, (second_len - shared,), generator=gen).tolist()


def record_prefill_forms(monkeypatch) -> Counter:
    """Count, per MLA layer call with several queries per sequence, the form it took: ``sparse``
    (a DSA selection), ``expanded`` / ``absorbed`` (dense groups)."""
    forms: Counter = Counter()
    original = MLAAttention._prefill

    def prefill(self, q_nope, q_pe, meta, batch, topk):
        if topk is not None:
            forms["sparse"] += 1
            assert topk.shape[1] < batch.max_seq_len, "a selection narrower than the context"
        else:
            for group in batch.dense_groups(self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim):
                forms["expanded" if group.expanded else "absorbed"] += 1
        return original(self, q_nope, q_pe, meta, batch, topk)

    monkeypatch.setattr(MLAAttention, "_prefill", prefill)
    return forms


def greedy_matches_transformers(path: Path, hf, step_tokens: int, first: list[int], second: list[int], shared: int,
                                max_tokens: int) -> None:
    """Run ``first`` then ``second`` through the engine with ``step_tokens`` per step and check that
    transformers' greedy choice at every generated position is the engine's, and that ``second``
    reused ``shared`` cached tokens."""
    llm = LLM(EngineArgs(model=str(path), block_size=4, num_blocks=128, max_num_batched_tokens=step_tokens),
              progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for prompt, hits in ((first, 0), (second, shared)):
        before = llm.core.block_manager.prefix_hits
        tokens = llm.generate([prompt], params)[0].token_ids
        assert llm.core.block_manager.prefix_hits - before == hits
        reference = hf_logits(hf, prompt + tokens[:-1])[len(prompt) - 1:].argmax(-1).tolist()
        assert reference == tokens, f"{step_tokens}-token steps: transformers {reference} vs ours {tokens}"
