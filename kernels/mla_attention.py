"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in absorbed form over a paged latent cache.

In absorbed form ``W_UK`` is folded into the query and ``W_UV`` is applied after attention, so
every head attends over the same per-token latent row ``[kv_lora_rank + qk_rope_head_dim]``:
the first ``kv_lora_rank`` entries are the compressed KV (``kv_a_layernorm`` applied), the
rest the RoPE'd shared key. Scores are ``scale * (q_nope_absorbed . c + q_pe . k_pe)`` and the
output is ``softmax . c``, i.e. ``[T, H, kv_lora_rank]`` before ``W_UV``. The sparse variant
(DeepSeek-V3.2 / GLM-5 DSA) attends only to the per-token top-k positions from the indexer.

The same op serves decode and DSA's sparse prefill: each query token reads only its ``k`` selected
latent rows, for all its heads at once (FlashMLA's ``flash_mla_sparse_fwd`` design: MQA over the
576-wide latent rows, ``O(T x H x k)`` work and no ``[T, S]`` intermediate).
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.paged_attention import token_seq_and_pos
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS


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
    block_size, row_width = latent_cache.shape[1], latent_cache.shape[-1]
    assert row_width == kv_lora_rank + q_pe.shape[-1], \
        f"latent row {row_width} != {kv_lora_rank} + {q_pe.shape[-1]}"
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    capacity = block_tables.shape[1] * block_size
    width = topk_indices.shape[1] if topk_indices is not None else min(max_seq_len or capacity, capacity)
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
    rows_per_chunk, keys_per_tile = absorbed_ref_tiles(width, row_width, num_heads)
    for start in range(0, num_tokens, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, num_tokens))
        topk = None if topk_indices is None else topk_indices[rows]
        rows_width = width
        if topk is None and query_start_loc is not None:     # prefill: no key after the chunk's last row
            rows_width = min(width, int(token_pos[rows].max()) + 1)                # (decode reads nothing back)
        out[rows] = _attend_rows_ref(q_nope[rows], q_pe[rows], latent_cache, block_tables, token_seq[rows],
                                     token_pos[rows], scale, topk, rows_width, keys_per_tile)
    return out


def absorbed_ref_tiles(width: int, row_width: int, num_heads: int) -> tuple[int, int]:
    """``(rows_per_chunk, keys_per_tile)`` of :func:`mla_attention_ref`: key tiles of up to 256 keys
    and as many query rows as keep the ``[rows, keys, L + R]`` gathered rows and the ``[rows, H,
    keys]`` scores within :data:`kernels.workspace.WORKSPACE_ELEMENTS` (also read by the plan's
    activation reserve)."""
    keys_per_tile = max(1, min(width, 256))
    return max(1, WORKSPACE_ELEMENTS // (keys_per_tile * max(row_width, num_heads))), keys_per_tile


def _attend_rows_ref(q_nope, q_pe, latent_cache, block_tables, token_seq, token_pos, scale, topk, width,
                     keys_per_tile) -> torch.Tensor:
    """:func:`mla_attention_ref` for a chunk of rows: online softmax over key tiles (FlashAttention's
    recurrence, float32). Returns ``[R, H, kv_lora_rank]`` in ``q_nope.dtype``."""
    kv_lora_rank = q_nope.shape[-1]
    block_size = latent_cache.shape[1]
    cache_rows = latent_cache.view(-1, latent_cache.shape[-1])
    q_nope, q_pe = q_nope.float(), q_pe.float()
    running_max = q_nope.new_full(q_nope.shape[:2], float("-inf"))              # [R, H]
    denom = q_nope.new_zeros(q_nope.shape[:2])                                  # [R, H]
    acc = torch.zeros_like(q_nope)                                              # [R, H, L]
    for lo in range(0, width, keys_per_tile):
        hi = min(lo + keys_per_tile, width)
        if topk is None:
            positions = torch.arange(lo, hi, device=q_nope.device).expand(q_nope.shape[0], hi - lo)
            valid = positions <= token_pos[:, None]
        else:
            positions = topk[:, lo:hi].long()
            valid = (positions >= 0) & (positions <= token_pos[:, None])
        positions = torch.where(valid, positions, 0)                            # [R, N]
        blocks = block_tables[token_seq[:, None], positions // block_size].long()
        rows = cache_rows[blocks * block_size + positions % block_size].float()
        latent, k_pe = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]        # [R, N, L], [R, N, Rope]
        scores = (torch.einsum("thl,tnl->thn", q_nope, latent)
                  + torch.einsum("thr,tnr->thn", q_pe, k_pe)) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)          # all-padding tiles
        probs = torch.exp(scores - safe_max[..., None])
        rescale = torch.exp(running_max - safe_max)
        denom = denom * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("thn,tnl->thl", probs, latent)
        running_max = new_max
    out = acc / torch.where(denom > 0, denom, 1.0)[..., None]                   # rows with no key: zeros
    return out


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
