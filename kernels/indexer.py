"""DSA lightning-indexer scoring and top-k selection (DeepSeek-V3.2 / GLM-5 sparse attention).

For query token t at position p and key position s of the same sequence, ``s <= p``::

    logits[t, s] = sum_h weights[t, h] * relu(q[t, h, :] . k[s, :])

over the paged indexer-key cache. HF's ``DeepseekV32Indexer`` computes
``sum_h w_h * n_heads**-0.5 * relu(q.k * softmax_scale)``; since ``softmax_scale > 0`` the caller
folds ``n_heads**-0.5 * softmax_scale`` into ``weights``. The Hadamard rotation is orthonormal,
so scoring rotated q/k gives the same logits. fp8 keys with per-block scales are not handled here.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.paged_attention import token_seq_and_pos

# Scores are computed in query-row chunks of at most this many [rows, H, S] float32 elements.
_SCORE_ELEMENTS = 1 << 24


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                       max_seq_len: int | None = None) -> torch.Tensor:
    """Causal indexer logits of packed queries over the paged key cache, in float32.

    Args:
        q: ``[T, H, index_head_dim]`` indexer queries (RoPE'd, optionally Hadamard-rotated).
        weights: ``[T, H]`` per-head weights, scales already folded in.
        k_cache: ``[num_blocks, block_size, index_head_dim]`` indexer keys (this step's stored).
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context length after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts; None means decode (``T == B``).
        max_seq_len: host-side bound on ``seq_lens``: the number of logit columns (default:
            the block table's capacity).

    Returns:
        ``[T, max_seq_len]`` float32; column s is key position s of the token's own sequence,
        ``-inf`` where ``s`` is after the token's position.
    """
    num_tokens, num_heads, _ = q.shape
    block_size = k_cache.shape[1]
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    capacity = block_tables.shape[1] * block_size
    width = min(max_seq_len or capacity, capacity)
    positions = torch.arange(width, device=q.device)
    num_blocks = -(-width // block_size)
    keys = k_cache[block_tables[:, :num_blocks].long()]                            # [B, blocks, block_size, D]
    keys = keys.view(keys.shape[0], num_blocks * block_size, -1)[:, :width].float()  # [B, S, D]
    q, weights = q.float(), weights.float()
    logits = q.new_empty(num_tokens, width)
    rows = max(1, _SCORE_ELEMENTS // max(1, num_heads * width))    # bounds the [rows, H, S] intermediate
    if query_start_loc is None:                                     # decode: token b is sequence b's query
        for start in range(0, num_tokens, rows):
            chunk = slice(start, start + rows)
            scores = torch.relu(torch.einsum("bhd,bsd->bhs", q[chunk], keys[chunk]))
            logits[chunk] = torch.einsum("bh,bhs->bs", weights[chunk], scores)
    else:
        bounds = query_start_loc.tolist()
        for seq, (first, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            for start in range(first, end, rows):
                chunk = slice(start, min(start + rows, end))
                scores = torch.relu(torch.einsum("thd,sd->ths", q[chunk], keys[seq]))
                logits[chunk] = torch.einsum("th,ths->ts", weights[chunk], scores)
    return logits.masked_fill(positions[None, :] > token_pos[:, None], float("-inf"))


def select_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Per-row top-k positions, best first, ``-1`` where a row has fewer than ``topk`` valid keys.

    Args:
        logits: ``[T, S]`` float32 with ``-inf`` at invalid positions.
        topk: ``k`` (2048 for DeepSeek-V3.2), may exceed ``S``.

    Returns:
        ``[T, topk]`` int32 key positions.
    """
    num_tokens, width = logits.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=logits.device)
    count = min(topk, width)
    if count > 0:
        values, idx = logits.topk(count, dim=-1, sorted=True)
        out[:, :count] = torch.where(values == float("-inf"), -1, idx).to(torch.int32)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                   max_seq_len: int | None = None) -> torch.Tensor:
    """Dispatching indexer logits (:func:`kernels.indexer_triton.indexer_scores_triton` or
    :func:`indexer_scores_ref`, same contract)."""
    if use_triton(q):
        from kernels.indexer_triton import indexer_scores_triton

        return indexer_scores_triton(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len)
    return indexer_scores_ref(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, topk: int, query_start_loc: torch.Tensor | None = None,
                 max_seq_len: int | None = None) -> torch.Tensor:
    """Top-k key positions per query token: :func:`indexer_scores` then :func:`select_topk`.

    Args:
        q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len: see
            :func:`indexer_scores_ref`.
        topk: keys kept per token.

    Returns:
        ``[T, topk]`` int32 positions (``-1`` padded), the input of the sparse
        :func:`kernels.mla_attention.mla_attention`.
    """
    logits = indexer_scores(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len)
    return select_topk(logits, topk)
