"""Paged KV cache write and causal attention over block tables (GQA).

A token's cache slot is ``block_table[pos // block_size] * block_size + pos % block_size``
(vLLM's PagedAttention, Kwon et al. 2023). Query tokens of all sequences are packed along one
dim; ``query_start_loc`` (``cu_seqlens_q``) marks where each sequence's queries start. The queries
of sequence b are its last ``q_len_b`` positions, so position ``seq_lens[b] - q_len_b + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardserve.kernels import cpu_attention
from shardserve.kernels.dispatch import use_triton


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V into the paged caches, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64 flat slot per token.
    """
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, _cast(key, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, _cast(value, v_cache.dtype))


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without a dispatcher call when it is already in ``dtype`` (decode steps are
    host-bound: every op counts)."""
    return x if x.dtype == dtype else x.to(dtype)


def store_cache_ref(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter per-token rows into one paged cache, in place (MLA latent, DSA indexer keys).

    Args:
        values: ``[num_tokens, *row_shape]``, e.g. ``[T, kv_lora_rank + qk_rope_head_dim]``.
        cache: ``[num_blocks, block_size, *row_shape]``.
        slot_mapping: ``[num_tokens]`` int flat slot per token.
    """
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping.long(), values.to(cache.dtype))


def token_seq_and_pos(query_start_loc: torch.Tensor | None, seq_lens: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index and position of every packed query token (no host sync).

    Args:
        query_start_loc: ``[B + 1]`` cumulative query counts, or None for decode (token b is
            the last position of sequence b, ``num_tokens == B``).
        seq_lens: ``[B]`` tokens in context after this step.
        num_tokens: packed query tokens ``T``.

    Returns:
        ``token_seq [T]`` and ``token_pos [T]`` (int64); token t sees positions ``0..token_pos[t]``.
    """
    if query_start_loc is None:
        assert seq_lens.shape[0] == num_tokens, f"decode: {seq_lens.shape[0]} seq_lens vs {num_tokens} tokens"
        return torch.arange(num_tokens, device=seq_lens.device), seq_lens.long() - 1
    token_idx = torch.arange(num_tokens, device=seq_lens.device, dtype=query_start_loc.dtype)
    token_seq = torch.searchsorted(query_start_loc[1:].contiguous(), token_idx, right=True)
    # Query i of sequence b sits at seq_len - q_len + i = seq_len - (query_end - token_idx).
    token_pos = seq_lens[token_seq].long() - (query_start_loc[token_seq + 1].long() - token_idx.long())
    return token_seq, token_pos


def gather_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots of positions ``0..max_seq_len-1`` of every sequence.

    Returns:
        slots ``[B, max_seq_len]`` int64 (valid where ``valid``) and valid ``[B, max_seq_len]`` bool.
    """
    pos = torch.arange(max_seq_len, device=block_tables.device)
    valid = pos[None, :] < seq_lens[:, None]
    block_idx = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables[:, block_idx].long()
    slots = blocks * block_size + (pos % block_size)[None, :]
    return torch.where(valid, slots, 0), valid


@dataclass(slots=True)
class PaddedLayout:
    """Where packed queries and paged keys go in a padded ``[B, Q, S]`` batch (torch path).

    Depends only on the step's metadata, so it is built once per step and shared by the layers
    (``step_cache`` of :func:`paged_attention_ref`).
    """

    padded_row: torch.Tensor     # [T] int64, row of each packed query token in the padded [B * Q] batch
    slots: torch.Tensor          # [B, S] int64, cache slot of every context position (0 where invalid)
    mask: torch.Tensor           # [B, 1, Q, S] bool, causal and length mask
    blocked: torch.Tensor        # [B, 1, 1, Q, S] bool, ~mask (what grouped_attention fills with -inf)


def padded_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  block_size: int, max_query_len: int, max_seq_len: int, num_tokens: int) -> PaddedLayout:
    """Build the :class:`PaddedLayout` of one step (shapes as in :func:`paged_attention_ref`)."""
    device = seq_lens.device
    batch = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                      # [B]
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
    row_of_token = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token]
    slots, valid = gather_slots(block_tables, seq_lens, block_size, max_seq_len)
    # Query row i of sequence b sits at position seq_len - q_len + i; it sees keys at <= that.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    k_pos = torch.arange(max_seq_len, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]   # [B, Q, S]
    mask[:, :, 0] |= ~mask.any(-1)  # padded rows see one key instead of none (no NaN); dropped later
    return PaddedLayout(seq_of_token * max_query_len + row_of_token, slots, mask[:, None], (~mask)[:, None, None])


@dataclass(slots=True)
class SubBatch:
    """The sequences of one kind in a mixed step (see :class:`MixedSplit`)."""

    token_idx: torch.Tensor        # [T_part] int64, packed query rows of its sequences, in order
    seq_idx: torch.Tensor          # [B_part] int64, its sequences in the step's batch
    seq_lens: torch.Tensor         # [B_part], tokens in context after this step
    query_start_loc: torch.Tensor  # [B_part + 1], cumulative query counts within the part
    max_query_len: int             # host-side maxima of the part
    max_seq_len: int
    step_cache: dict               # the part's own per-step cache (layouts of the part's shape)


@dataclass(slots=True)
class MixedSplit:
    """A step that holds decodes (one query token) and prefills or prefill chunks (several).

    NOTE: padding every sequence's queries to the step's longest query (:class:`PaddedLayout`)
    would have each decode attend ``max_query_len`` rows (33x the decode's work for one 33-token
    prompt in a batch of decodes, measured ~6x the time per decode on 2 CPU cores); split, the
    decodes take the decode path and only the prefills are padded, to the longest prefill.
    """

    parts: tuple[SubBatch, SubBatch]   # (decodes, prefills)


def mixed_split(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                step_cache: dict | None = None) -> MixedSplit | None:
    """The decode / prefill split of one step, or None unless it has both (kept in ``step_cache``).
    Reads the lengths on the host: for CPU tensors only (CUDA runs the Triton kernel, varlen).

    Args:
        query_start_loc: ``[B + 1]`` cumulative query counts. seq_lens: ``[B]``.
        max_query_len: host-side maximum query count (1: a decode step, never split).
    """
    if max_query_len == 1:
        return None
    if step_cache is not None and "mixed_split" in step_cache:
        return step_cache["mixed_split"]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                      # [B]
    is_decode = q_lens == 1
    num_decodes = int(is_decode.sum())
    split = None
    if 0 < num_decodes < q_lens.shape[0]:
        parts = []
        for seq_idx in (is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0]):
            starts, lens = query_start_loc[seq_idx].long(), q_lens[seq_idx].long()
            token_idx = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens) + torch.arange(
                int(lens.sum()), device=lens.device)
            part_lens = seq_lens[seq_idx]
            parts.append(SubBatch(token_idx, seq_idx, part_lens, torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(
                query_start_loc.dtype), int(lens.max()), int(part_lens.max()), {}))
        split = MixedSplit(tuple(parts))
    if step_cache is not None:
        step_cache["mixed_split"] = split
    return split


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, max_query_len: int, max_seq_len: int,
                        step_cache: dict | None = None) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged K/V.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (this step's K/V
            already stored); ``num_heads % num_kv_heads == 0``.
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int, tokens in context after this step.
        query_start_loc: ``[B + 1]`` int, cumulative query counts.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        max_query_len, max_seq_len: host-side maxima of the per-sequence lengths.
        step_cache: a dict living for one forward step; the :class:`PaddedLayout` is kept there
            so the layers of a step build it once.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    num_tokens, num_heads, head_dim = query.shape
    split = mixed_split(query_start_loc, seq_lens, max_query_len, step_cache) if query.device.type == "cpu" else None
    if split is not None:   # decodes and prefills in one step: each part on its own path
        out = torch.empty_like(query)
        for part in split.parts:
            out[part.token_idx] = paged_attention_ref(
                query[part.token_idx], k_cache, v_cache, block_tables[part.seq_idx], part.seq_lens,
                part.query_start_loc, scale, part.max_query_len, part.max_seq_len, part.step_cache)
        return out
    decode = max_query_len == 1 and num_tokens == seq_lens.shape[0]   # one query per sequence, in order
    if decode and query.dtype != torch.float32:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, step_cache)
    layout = None if step_cache is None else step_cache.get("padded_layout")
    if layout is None:
        layout = padded_layout(block_tables, seq_lens, query_start_loc, k_cache.shape[1], max_query_len,
                               max_seq_len, num_tokens)
        if step_cache is not None:
            step_cache["padded_layout"] = layout
    batch = seq_lens.shape[0]
    # NOTE: 1-D index_copy_ / index_select, not 2-D advanced indexing (index_put / index): the
    # latter took ~40% of a 32-token prefill step on 2 CPU cores, these a few percent.
    if decode:
        q_pad = query[:, None]
    elif batch == 1:   # one prefill: its queries are the padded batch
        q_pad = query[None]
    else:
        q_pad = query.new_zeros(batch * max_query_len, num_heads, head_dim).index_copy_(
            0, layout.padded_row, query).view(batch, max_query_len, num_heads, head_dim)
    width = layout.slots.shape[1]
    if query.dtype == torch.float32:
        num_kv = k_cache.shape[2]
        flat = layout.slots.view(-1)
        keys = k_cache.view(-1, num_kv, head_dim).index_select(0, flat).view(batch, width, num_kv, head_dim)
        values = v_cache.view(-1, num_kv, head_dim).index_select(0, flat).view(batch, width, num_kv, head_dim)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), _cast(keys, query.dtype).transpose(1, 2), _cast(values, query.dtype).transpose(1, 2),
            attn_mask=layout.mask, scale=scale, enable_gqa=num_heads != k_cache.shape[2]).transpose(1, 2)
    else:
        rows = _head_rows(layout, k_cache.shape[2], step_cache)                   # [B * Hkv * S]
        shape = (batch, k_cache.shape[2], width, head_dim)
        keys = _cast(k_cache.view(-1, head_dim).index_select(0, rows).view(shape), query.dtype)   # [B, Hkv, S, D]
        values = _cast(v_cache.view(-1, head_dim).index_select(0, rows).view(shape), query.dtype)
        out = grouped_attention(q_pad, keys, values, layout.mask, scale, layout.blocked)
    if decode:
        return out[:, 0]
    if batch == 1:
        return out[0].contiguous()   # NOTE: callers (the compiled forward's opaque op) take contiguous rows
    return out.reshape(batch * max_query_len, num_heads, head_dim).index_select(0, layout.padded_row)


def _head_rows(layout: PaddedLayout, num_kv_heads: int, step_cache: dict | None) -> torch.Tensor:
    """``[B * Hkv * S]`` rows of a cache viewed as ``[slots * Hkv, D]``: gathering them yields each
    KV head's keys contiguous (``[B, Hkv, S, D]``), the layout both matmuls of
    :func:`grouped_attention` read in place. Built once per step (kept in ``step_cache``)."""
    key = ("head_rows", num_kv_heads)
    rows = None if step_cache is None else step_cache.get(key)
    if rows is None:
        heads = torch.arange(num_kv_heads, device=layout.slots.device)
        rows = (layout.slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        if step_cache is not None:
            step_cache[key] = rows
    return rows


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                           step_cache: dict | None = None) -> torch.Tensor:
    """One query token per sequence over its paged K/V (the bf16 / fp16 decode path on CPU).

    Each sequence's first ``ceil(max_seq_len / block_size)`` blocks are gathered whole (one
    ``index_select`` per cache) and read in place as ``[B, Hkv, W, D]`` through a transposed view;
    positions past a sequence's length are masked (cut instead, for one sequence). A decode query
    sees every valid key, so the ``G`` query heads that share a KV head are ``G`` query rows of one
    attention over that head's keys: torch's CPU flash-attention kernel runs it without repeating
    K/V. A bf16 ``bmm`` would build a new oneDNN primitive whenever the context grows (about 1 ms,
    twice per step; ``benchmarks/profile_decode.py``), and a per-position gather costs 4x the
    block gather.

    Args:
        query: ``[B, H, D]``; query head ``h`` reads key head ``h // (H / Hkv)`` (HF ``repeat_kv``).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (this step's K/V already stored).
        block_tables: ``[B, max_blocks]`` int (padded with any valid block id).
        seq_lens: ``[B]`` int, tokens in context after this step. max_seq_len: their maximum (host int).
        step_cache: per-step dict; the gathered block ids and the length mask are kept there.

    Returns:
        ``[B, H, D]`` in ``query.dtype``.
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    width = -(-max_seq_len // block_size) * block_size
    cached = None if step_cache is None else step_cache.get("decode_blocks")
    if cached is None:
        blocks = block_tables[:, :width // block_size].reshape(-1).long()
        mask = None if batch == 1 else (torch.arange(width, device=seq_lens.device) < seq_lens[:, None])[:, None, None]
        cached = (blocks, mask)                                                      # mask: [B, 1, 1, W]
        if step_cache is not None:
            step_cache["decode_blocks"] = cached
    blocks, mask = cached
    length = max_seq_len if batch == 1 else width

    def gather(cache: torch.Tensor) -> torch.Tensor:                                  # [B, Hkv, length, D]
        whole = cache.index_select(0, blocks).view(batch, width, num_kv, head_dim)
        return _cast(whole[:, :length].transpose(1, 2), query.dtype)

    q = query.view(batch, num_kv, num_heads // num_kv, head_dim)                      # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out.view(batch, num_heads, head_dim)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype``'s precision, kept in float32."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, blocked: torch.Tensor | None = None) -> torch.Tensor:
    """Masked GQA attention as two batched matmuls, all in float32 (the bf16 / fp16 path: torch's
    CPU flash-attention kernel takes 3 ms where this takes 0.2 ms for 32 decode rows).

    NOTE: float32 on purpose: on a CPU without native bf16 (AVX2) a bf16 ``matmul`` of one prefill's
    scores took 6x, of four 12x, the time of upcasting its inputs and multiplying in float32.

    Args:
        query: ``[B, Q, H, D]``; query head ``h`` reads key head ``h // (H / Hkv)`` (HF ``repeat_kv``).
        keys, values: ``[B, Hkv, S, D]`` (head-major). mask: ``[B, 1, Q, S]`` bool, True = attend.
        blocked: ``~mask[:, :, None]`` when the caller has it (one step's layers share it).

    Returns:
        ``[B, Q, H, D]`` in ``query.dtype``.
    """
    batch, num_q, num_heads, head_dim = query.shape
    num_kv = keys.shape[1]
    group = num_heads // num_kv
    q = query.view(batch, num_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4).reshape(
        batch, num_kv, group * num_q, head_dim).float()                             # [B, Hkv, G*Q, D]
    # Rounded to the input dtype where a bf16 matmul would round (scores, probs): the same numbers.
    scores = _round_to(torch.matmul(q, keys.float().transpose(-1, -2)), query.dtype).mul_(scale)   # [B, Hkv, G*Q, S]
    blocked = ~mask[:, :, None] if blocked is None else blocked
    scores = scores.view(batch, num_kv, group, num_q, -1).masked_fill_(blocked, float("-inf"))
    probs = _round_to(scores.softmax(dim=-1), query.dtype).view(batch, num_kv, group * num_q, -1)
    out = torch.matmul(probs, values.float())                                       # [B, Hkv, G*Q, D]
    return out.view(batch, num_kv, group, num_q, head_dim).permute(0, 3, 1, 2, 4).reshape(
        batch, num_q, num_heads, head_dim).to(query.dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Dispatching K/V store (:func:`kernels.paged_attention_triton.store_kv_triton` or
    :func:`store_kv_ref`, same contract)."""
    if use_triton(key):
        from shardserve.kernels.paged_attention_triton import store_kv_triton

        return store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def store_cache(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Dispatching single-cache store (:func:`kernels.paged_attention_triton.store_cache_triton`
    or :func:`store_cache_ref`, same contract)."""
    if use_triton(values):
        from shardserve.kernels.paged_attention_triton import store_cache_triton

        return store_cache_triton(values, cache, slot_mapping)
    store_cache_ref(values, cache, slot_mapping)


def store_kv_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, step_cache: dict | None = None) -> torch.Tensor:
    """:func:`store_kv` then :func:`paged_attention` (same arguments and result); a small bf16
    decode step on CPU does both in one C call (:func:`kernels.cpu_attention.decode_attention`)."""
    if (query.dtype == torch.bfloat16 and max_query_len == 1 and query.shape[0] == seq_lens.shape[0]
            and not query.is_cuda and not torch.compiler.is_compiling()):   # (SHARDSERVE_KERNELS: checked inside)
        out = cpu_attention.decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                             key, value, slot_mapping, step_cache)
        if out is not None:
            return out
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    return paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
                           max_seq_len, step_cache)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    step_cache: dict | None = None) -> torch.Tensor:
    """Dispatching paged attention (:func:`kernels.paged_attention_triton.paged_attention_triton`
    or :func:`paged_attention_ref`, same contract; the Triton kernel handles prefill and decode).

    ``step_cache``: see :func:`paged_attention_ref`."""
    if use_triton(query):
        from shardserve.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                      scale, max_query_len, max_seq_len)
    return paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               scale, max_query_len, max_seq_len, step_cache)
