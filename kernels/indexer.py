"""DSA lightning-indexer scoring and top-k selection (DeepSeek-V3.2 / GLM-5 sparse attention).

For query token t at position p and key position s of the same sequence, ``s <= p``::

    logits[t, s] = sum_h weights[t, h] * relu(q[t, h, :] . k[s, :])

over the paged indexer-key cache. HF's ``DeepseekV32Indexer`` computes
``sum_h w_h * n_heads**-0.5 * relu(q.k * softmax_scale)``; since ``softmax_scale > 0`` the caller
folds ``n_heads**-0.5 * softmax_scale`` into ``weights``. The Hadamard rotation is orthonormal,
so scoring rotated q/k gives the same logits.

The key cache is either in a float dtype (``[num_blocks, block_size, D]``) or in DeepSeek-V3.2's
fp8 format (``inference/model.py``: ``act_quant(k, 128, scale_fmt="ue8m0")`` into ``k_cache`` +
``k_scale_cache``), packed per slot as one ``uint8`` row (:func:`quantize_index_keys`): ``D``
float8_e4m3fn values, then one float32 scale per group of 128 dims (a power of two, so
``value * scale`` is exact). Only keys are quantized; queries stay in the model dtype.
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.paged_attention import token_seq_and_pos

FP8_GROUP = 128               # dims sharing one scale (DeepSeek-V3.2 act_quant block size)
FP8_MAX = 448.0               # largest finite float8_e4m3fn


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one packed fp8 key row: ``head_dim`` fp8 values + a float32 scale per 128 dims.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 4 (the scales must be float32-aligned).
    """
    if head_dim % 4:
        raise ValueError(f"fp8 indexer cache needs index_head_dim % 4 == 0, got {head_dim}")
    return head_dim + 4 * -(-head_dim // FP8_GROUP)


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Quantize indexer keys to packed fp8 rows.

    Per group of up to 128 dims: ``scale = 2**ceil(log2(amax / 448))`` (ue8m0, as DeepSeek-V3.2's
    ``act_quant`` with ``scale_fmt="ue8m0"``; 1 for an all-zero group), values
    ``(k / scale).to(float8_e4m3fn)``.

    Args:
        keys: ``[T, D]`` float keys (after RoPE and Hadamard rotation).

    Returns:
        ``[T, fp8_row_bytes(D)]`` uint8: the ``D`` fp8 bytes, then ``ceil(D / 128)`` float32 scales.
    """
    num_tokens, head_dim = keys.shape
    groups = -(-head_dim // FP8_GROUP)
    padded = torch.nn.functional.pad(keys.float(), (0, groups * FP8_GROUP - head_dim)).view(num_tokens, groups, -1)
    amax = padded.abs().amax(-1).clamp(min=1e-30)                                   # [T, G]
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    values = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = values.view(num_tokens, -1)[:, :head_dim]
    return torch.cat((values.view(torch.uint8), scale.view(torch.uint8).view(num_tokens, -1)), dim=-1)


def dequantize_index_keys(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`quantize_index_keys`: ``[..., fp8_row_bytes(D)]`` uint8 -> ``[..., D]`` float32."""
    values = rows[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float32)                    # [..., G]
    return values * scales.repeat_interleave(FP8_GROUP, dim=-1)[..., :head_dim]


# Scores are computed in query-row chunks of at most this many [rows, H, S] float32 elements.
_SCORE_ELEMENTS = 1 << 24


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                       max_seq_len: int | None = None) -> torch.Tensor:
    """Causal indexer logits of packed queries over the paged key cache, in float32.

    Args:
        q: ``[T, H, index_head_dim]`` indexer queries (RoPE'd, optionally Hadamard-rotated).
        weights: ``[T, H]`` per-head weights, scales already folded in.
        k_cache: ``[num_blocks, block_size, index_head_dim]`` float indexer keys, or
            ``[num_blocks, block_size, fp8_row_bytes(index_head_dim)]`` uint8 packed fp8 keys
            (:func:`quantize_index_keys`); this step's keys already stored.
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context length after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts; None means decode (``T == B``).
        max_seq_len: host-side bound on ``seq_lens``: the number of logit columns (default:
            the block table's capacity).

    Returns:
        ``[T, max_seq_len]`` float32; column s is key position s of the token's own sequence,
        ``-inf`` where ``s`` is after the token's position.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    capacity = block_tables.shape[1] * block_size
    width = min(max_seq_len or capacity, capacity)
    positions = torch.arange(width, device=q.device)
    num_blocks = -(-width // block_size)
    keys = k_cache[block_tables[:, :num_blocks].long()]                            # [B, blocks, block_size, D]
    keys = keys.view(keys.shape[0], num_blocks * block_size, -1)[:, :width]
    keys = dequantize_index_keys(keys, head_dim) if k_cache.dtype == torch.uint8 else keys.float()  # [B, S, D]
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
        from shardserve.kernels.indexer_triton import indexer_scores_triton

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
