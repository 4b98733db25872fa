"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in absorbed form over a paged latent cache.

In absorbed form ``W_UK`` is folded into the query and ``W_UV`` is applied after attention, so
every head attends over the same per-token latent row ``[kv_lora_rank + qk_rope_head_dim]``:
the first ``kv_lora_rank`` entries are the compressed KV (``kv_a_layernorm`` applied), the
rest the RoPE'd shared key. Scores are ``scale * (q_nope_absorbed . c + q_pe . k_pe)`` and the
output is ``softmax . c``, i.e. ``[T, H, kv_lora_rank]`` before ``W_UV``. The sparse variant
(DeepSeek-V3.2 / GLM-5 DSA) attends only to the per-token top-k positions from the indexer.
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.paged_attention import token_seq_and_pos


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      query_start_loc: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
                      max_seq_len: int | None = None) -> torch.Tensor:
    """Causal absorbed-MLA attention of packed queries over the paged latent cache (float32 math).

    Args:
        q_nope: ``[T, H, kv_lora_rank]`` query already multiplied by ``W_UK`` (absorbed).
        q_pe: ``[T, H, qk_rope_head_dim]`` RoPE'd query part.
        latent_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (this step's
            rows already stored, e.g. with :func:`kernels.paged_attention.store_cache`).
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context length after this step.
        scale: softmax scale (``qk_head_dim ** -0.5`` times YaRN's mscale**2 where used).
        query_start_loc: ``[B + 1]`` cumulative query counts (prefill / mixed batches); None
            means decode, one query per sequence (``T == B``). Query i of sequence b is at
            position ``seq_lens[b] - q_len_b + i`` and sees positions ``<=`` its own.
        topk_indices: optional ``[T, topk]`` int positions (within the token's sequence) to attend
            to instead of the whole causal context; ``-1`` is padding. Positions after the
            query's own are ignored too. A row with no valid index outputs zeros.
        max_seq_len: host-side bound on ``seq_lens`` for the dense case (default: the block
            table's capacity); only sizes the gather.

    Returns:
        ``[T, H, kv_lora_rank]`` in ``q_nope.dtype``.
    """
    num_tokens, num_heads, kv_lora_rank = q_nope.shape
    block_size = latent_cache.shape[1]
    assert latent_cache.shape[-1] == kv_lora_rank + q_pe.shape[-1], \
        f"latent row {latent_cache.shape[-1]} != {kv_lora_rank} + {q_pe.shape[-1]}"
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    capacity = block_tables.shape[1] * block_size
    if topk_indices is None:
        width = min(max_seq_len or capacity, capacity)
        positions = torch.arange(width, device=q_nope.device).expand(num_tokens, width)
        valid = positions <= token_pos[:, None]
    else:
        positions = topk_indices.long()
        valid = (positions >= 0) & (positions <= token_pos[:, None])
    positions = torch.where(valid, positions, 0)                                  # [T, N]
    blocks = block_tables[token_seq[:, None], positions // block_size].long()
    rows = latent_cache.view(-1, latent_cache.shape[-1])[blocks * block_size + positions % block_size].float()
    latent, k_pe = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]              # [T, N, L], [T, N, R]
    scores = (torch.einsum("thl,tnl->thn", q_nope.float(), latent)
              + torch.einsum("thr,tnr->thn", q_pe.float(), k_pe)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked sparse rows -> zeros
    return torch.einsum("thn,tnl->thl", probs, latent).to(q_nope.dtype)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  query_start_loc: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
                  max_seq_len: int | None = None) -> torch.Tensor:
    """Dispatching absorbed MLA attention (:func:`kernels.mla_attention_triton.mla_attention_triton`
    or :func:`mla_attention_ref`, same contract, dense or sparse, prefill or decode)."""
    if use_triton(q_nope):
        from shardserve.kernels.mla_attention_triton import mla_attention_triton

        return mla_attention_triton(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale,
                                    query_start_loc, topk_indices, max_seq_len)
    return mla_attention_ref(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale,
                             query_start_loc, topk_indices, max_seq_len)
