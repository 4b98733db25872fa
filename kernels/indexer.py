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
``value * scale`` is exact). With an fp8 key cache the queries are quantized the same way, one
scale per head and group (``act_quant(q)``), and scored fp8 x fp8 (``fp8_index``).
"""

from __future__ import annotations

import torch

from shardserve.kernels.dispatch import use_triton
from shardserve.kernels.paged_attention import token_seq_and_pos
from shardserve.kernels.workspace import WORKSPACE_ELEMENTS, plan_row_chunks

FP8_GROUP = 128               # dims sharing one scale (DeepSeek-V3.2 act_quant block size)
FP8_MAX = 448.0               # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-4        # act_quant's floor on a group's absolute maximum


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one packed fp8 key row: ``head_dim`` fp8 values + a float32 scale per 128 dims.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 4 (the scales must be float32-aligned).
    """
    if head_dim % 4:
        raise ValueError(f"fp8 indexer cache needs index_head_dim % 4 == 0, got {head_dim}")
    return head_dim + 4 * -(-head_dim // FP8_GROUP)


def fp8_group_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128-dim e4m3 quantization with power-of-two scales, bit for bit DeepSeek-V3.2's
    ``inference/kernel.py: act_quant(x, 128, scale_fmt="ue8m0")``.

    Per group of up to 128 dims of the last axis: ``amax = max(|x|)`` floored at 1e-4, ``scale =
    2**ceil(log2(amax * float32(1/448)))`` taken from the float32 bits as ``fast_round_scale``
    does (the exponent, plus one where the mantissa is non-zero; a float ``log2`` of a value just
    above a power of two can round down to it and halve the scale), values ``clamp(x / scale,
    +-448)`` rounded to nearest-even e4m3; ``values * scale`` is exact.

    Args:
        x: ``[..., D]`` float.

    Returns:
        ``(values [..., D] float8_e4m3fn, scales [..., ceil(D / 128)] float32)``.
    """
    head_dim = x.shape[-1]
    groups = -(-head_dim // FP8_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * FP8_GROUP - head_dim))
    padded = padded.view(*x.shape[:-1], groups, FP8_GROUP)
    ratio = padded.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR) * torch.tensor(1 / FP8_MAX)     # [..., G] float32
    bits = ratio.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()                        # biased ceil(log2)
    scale = (exponent << 23).view(torch.float32)
    values = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.flatten(-2)[..., :head_dim], scale


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Quantize indexer keys to packed fp8 rows (:func:`fp8_group_quantize`).

    Args:
        keys: ``[T, D]`` float keys (after RoPE and Hadamard rotation).

    Returns:
        ``[T, fp8_row_bytes(D)]`` uint8: the ``D`` fp8 bytes, then ``ceil(D / 128)`` float32 scales.
    """
    values, scale = fp8_group_quantize(keys)
    return torch.cat((values.view(torch.uint8), scale.view(torch.uint8).view(keys.shape[0], -1)), dim=-1)


def quantize_index_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries for fp8 scoring (DeepSeek-V3.2 ``Indexer.forward``: ``act_quant(q)``).

    Args:
        q: ``[T, H, D]`` float queries (after RoPE and Hadamard rotation).

    Returns:
        ``(q_fp8 [T, H, D] float8_e4m3fn, q_scale [T, H, ceil(D / 128)] float32)``, the
        ``q`` and ``q_scale`` arguments of :func:`indexer_scores` / :func:`indexer_topk`.
    """
    values, scale = fp8_group_quantize(q)
    return values.contiguous(), scale.contiguous()


def dequantize_index_queries(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_index_queries`: ``[T, H, D]`` float32 (exact)."""
    return q.float() * q_scale.repeat_interleave(FP8_GROUP, dim=-1)[..., :q.shape[-1]]


def dequantize_index_keys(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`quantize_index_keys`: ``[..., fp8_row_bytes(D)]`` uint8 -> ``[..., D]`` float32."""
    values = rows[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float32)                    # [..., G]
    return values * scales.repeat_interleave(FP8_GROUP, dim=-1)[..., :head_dim]


def check_fp8_queries(q: torch.Tensor, q_scale: torch.Tensor | None, k_cache: torch.Tensor) -> None:
    """Validate the query format against the key cache (shared by the reference and the kernel).

    Raises:
        ValueError: fp8 queries without their scales (or the reverse), scales of the wrong shape,
            or fp8 queries over a float key cache.
    """
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 != (q_scale is not None):
        raise ValueError(f"q {q.dtype} with q_scale {None if q_scale is None else tuple(q_scale.shape)}: "
                         "fp8 queries come with their scales, float queries without")
    if fp8:
        groups = -(-q.shape[-1] // FP8_GROUP)
        if tuple(q_scale.shape) != (*q.shape[:-1], groups) or q_scale.dtype != torch.float32:
            raise ValueError(f"q_scale {tuple(q_scale.shape)} {q_scale.dtype}: expected float32 "
                             f"{(*q.shape[:-1], groups)}")
        if k_cache.dtype != torch.uint8:
            raise ValueError("fp8 indexer queries score against the fp8 key cache only")


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                       max_seq_len: int | None = None, *, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal indexer logits of packed queries over the paged key cache, in float32.

    Args:
        q: ``[T, H, index_head_dim]`` indexer queries (RoPE'd, optionally Hadamard-rotated), float;
            or float8_e4m3fn values from :func:`quantize_index_queries` (fp8 key cache only).
        weights: ``[T, H]`` per-head weights, scales already folded in.
        k_cache: ``[num_blocks, block_size, index_head_dim]`` float indexer keys, or
            ``[num_blocks, block_size, fp8_row_bytes(index_head_dim)]`` uint8 packed fp8 keys
            (:func:`quantize_index_keys`); this step's keys already stored.
        block_tables: ``[B, max_blocks]`` int.
        seq_lens: ``[B]`` int, context length after this step.
        query_start_loc: ``[B + 1]`` cumulative query counts; None means decode (``T == B``).
        max_seq_len: host-side bound on ``seq_lens``: the number of logit columns (default:
            the block table's capacity).
        q_scale: ``[T, H, ceil(index_head_dim / 128)]`` float32 scales of fp8 ``q``, else None.

    Returns:
        ``[T, max_seq_len]`` float32; column s is key position s of the token's own sequence,
        ``-inf`` where ``s`` is after the token's position. (This materializes ``T x S``: the
        serving path, :func:`indexer_topk`, scores bounded row chunks instead.)

    Raises:
        ValueError: see :func:`check_fp8_queries`.
    """
    check_fp8_queries(q, q_scale, k_cache)
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, q.shape[0])
    width = _width(max_seq_len, block_tables, k_cache)
    segments = None
    if query_start_loc is not None:
        bounds = query_start_loc.tolist()
        segments = tuple((first, end, seq, min(width, length))
                         for seq, (first, end, length) in enumerate(zip(bounds[:-1], bounds[1:], seq_lens.tolist())))
    return score_rows_ref(q, weights, k_cache, block_tables, token_seq, token_pos, width, segments, q_scale)


def _width(max_seq_len: int | None, block_tables: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Logit columns: ``max_seq_len`` capped at the block table's capacity."""
    capacity = block_tables.shape[1] * k_cache.shape[1]
    return min(max_seq_len or capacity, capacity)


def _keys(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cached key rows as float32 (dequantized when packed fp8)."""
    return dequantize_index_keys(rows, head_dim) if rows.dtype == torch.uint8 else rows.float()


# The reference's score tiles ([rows, H, keys] and their weighted sum) hold a quarter of the
# workspace each, beside the chunk's logits: at most 7 bytes per workspace element in all.
_TILE_ELEMENTS = WORKSPACE_ELEMENTS // 4
# Runs of at most this many rows of one sequence (an MTP verify step's 1 + k rows, a mixed step's
# decode rows) are scored together, each row gathering its own keys as decode rows do: one loop
# per run was the larger part of a batch-32 verify step of the demo model on CPU (issue 31).
SHORT_SEGMENT_ROWS = 8


def score_rows_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   token_seq: torch.Tensor, token_pos: torch.Tensor, width: int,
                   segments: tuple[tuple[int, int, int, int], ...] | None,
                   q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of some query rows against key positions ``0..width-1`` of their sequences, walking
    key tiles of a quarter of :data:`kernels.workspace.WORKSPACE_ELEMENTS` elements.

    Args:
        q, weights, k_cache, block_tables, q_scale: see :func:`indexer_scores_ref` (``R`` rows).
        token_seq, token_pos: ``[R]`` sequence and position of each row.
        width: logit columns.
        segments: ``(first_row, end_row, seq, num_keys)`` runs of rows sharing a sequence, in step
            rows (the first run starts at row 0 of ``q``): a run of more than
            :data:`SHORT_SEGMENT_ROWS` rows gathers its keys ``0..num_keys-1`` once per tile, the
            shorter ones are scored together, each row gathering its own keys; None: every row has
            its own sequence (decode).

    Returns:
        ``[R, width]`` float32, ``-inf`` after each row's position.
    """
    num_rows, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    cache_rows = k_cache.view(-1, k_cache.shape[-1])
    q = q.float() if q_scale is None else dequantize_index_queries(q, q_scale)    # exact: power-of-two scales
    weights = weights.float()
    # Every column is written below or lies after its row's position (masked at the end).
    logits = torch.empty(num_rows, width, dtype=torch.float32, device=q.device)
    if segments is None:                                               # decode: one sequence per row
        _score_own_keys(q, weights, cache_rows, block_tables, token_seq, block_size, logits)
    else:
        base = segments[0][0] if segments else 0
        short = [s for s in segments if 0 < s[1] - s[0] <= SHORT_SEGMENT_ROWS]
        if short:                                                       # verify rows, a mixed step's decodes
            rows = torch.cat([torch.arange(first - base, end - base) for first, end, _, _ in short]).to(q.device)
            part = logits.new_empty(rows.numel(), min(width, max(num_keys for _, _, _, num_keys in short)))
            _score_own_keys(q[rows], weights[rows], cache_rows, block_tables, token_seq[rows], block_size, part)
            logits[rows, :part.shape[1]] = part
        for first, end, seq, num_keys in segments:
            if end - first <= SHORT_SEGMENT_ROWS:
                continue
            rows = slice(first - base, end - base)
            seq_width = min(width, num_keys)                                # causal: no key after the last row
            tile = max(block_size, _TILE_ELEMENTS // max(1, (end - first) * num_heads))   # [rows, H, tile]
            for lo in range(0, seq_width, tile):
                pos = torch.arange(lo, min(lo + tile, seq_width), device=q.device)
                slots = block_tables[seq, pos // block_size].long() * block_size + pos % block_size
                keys = _keys(cache_rows[slots], head_dim)                                   # [N, D]
                scores = torch.einsum("rhd,nd->rhn", q[rows], keys).relu_()
                logits[rows, lo:lo + pos.numel()] = torch.einsum("rh,rhn->rn", weights[rows], scores)
    positions = torch.arange(width, device=q.device)
    return logits.masked_fill_(positions[None, :] > token_pos[:, None], float("-inf"))


def _score_own_keys(q: torch.Tensor, weights: torch.Tensor, cache_rows: torch.Tensor, block_tables: torch.Tensor,
                    token_seq: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Logits of rows that each gather their own sequence's keys ``0..width-1`` into ``out``
    (decode rows, and the short runs of a verify or mixed step scored as if they were decode rows;
    columns after a row's position get scores of whatever the block table points at: the caller
    masks them).

    Args:
        q: ``[R, H, D]`` float32; weights: ``[R, H]`` float32; cache_rows: ``[slots, row bytes or D]``
            the key cache by slot; token_seq: ``[R]`` each row's sequence (its block-table row).
        out: ``[R, width]`` float32, written.
    """
    num_rows, num_heads, head_dim = q.shape
    width = out.shape[1]
    tile = max(block_size, _TILE_ELEMENTS // max(1, num_rows * max(num_heads, head_dim)))
    for lo in range(0, width, tile):
        pos = torch.arange(lo, min(lo + tile, width), device=q.device)
        slots = block_tables[token_seq[:, None], pos // block_size].long() * block_size + pos % block_size
        keys = _keys(cache_rows[slots], head_dim)                                           # [R, N, D]
        scores = torch.einsum("rhd,rnd->rhn", q, keys).relu_()
        out[:, lo:lo + pos.numel()] = torch.einsum("rh,rhn->rn", weights, scores)


def select_topk(logits: torch.Tensor, topk: int, sink: int = 0, *, consume: bool = False) -> torch.Tensor:
    """Per-row top-k positions, best first, ``-1`` where a row has fewer than ``topk`` valid keys.

    Args:
        logits: ``[T, S]`` float32 with ``-inf`` at invalid positions; column s is position s of
            the row's own sequence.
        topk: ``k`` (2048 for DeepSeek-V3.2), may exceed ``S``.
        sink: the first ``sink`` positions of each row's sequence are always selected where the
            row sees them (attention sink, ik_llama.cpp's GLM-5.2 DSA port); they take the places
            of the lowest-ranked keys, so a row still keeps ``k`` keys. 0 = plain top-k.
        consume: ``logits`` may be overwritten (the tie-break's scratch: no second ``[T, S]``
            tensor); :func:`indexer_topk` drops each chunk's logits after this call anyway.

    Keys tied exactly at the boundary are kept lowest position first (:func:`_lowest_tied_positions`),
    so a query's selection does not depend on how many rows its step scores at once.

    Returns:
        ``[T, topk]`` int32 key positions (with a sink: the sink positions first, ``-1`` where a
        row does not see them yet, then the best other keys); ``-1`` padding trails.
    """
    num_tokens, width = logits.shape
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=logits.device)
    forced = min(sink, width, topk)                 # the sink columns, kept where the row sees them
    if forced:
        head = torch.arange(forced, dtype=torch.int32, device=logits.device).expand(num_tokens, forced)
        out[:, :forced] = torch.where(logits[:, :forced] == float("-inf"), -1, head)
    count = min(topk, width) - forced               # the best of the other columns fill the rest
    if count > 0:
        values, idx = logits[:, forced:].topk(count, dim=-1, sorted=True)
        rest = logits[:, forced:] if consume else logits[:, forced:].clone()
        idx = _lowest_tied_positions(rest, values, idx)
        out[:, forced:forced + count] = torch.where(values == float("-inf"), -1, idx + forced).to(torch.int32)
    return out


def _lowest_tied_positions(scratch: torch.Tensor, values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Break exact ties at the top-k boundary toward the lowest positions, whatever the layout.

    ``torch.topk`` picks among equal values in an order that depends on the tensor's shape, so a
    query scored as one row of a decode step and as a row of a multi-row verify or prefill chunk
    could keep different keys with the same scores. Exact ties are common: a key that no indexer
    head scores positively has logit exactly 0 (``relu``), and with few heads that is a sizeable
    share of the keys. Every selected entry equal to the k-th value is replaced by the lowest
    positions holding that value, in ascending order, so the selection is a function of the row's
    values only (deterministic at any batch shape).

    Args:
        scratch: ``[T, S]`` float32 row logits, overwritten in place by the running count of the
            columns tied with the row's k-th value (0/1 then a prefix sum: exact in float32 up to
            2^24 columns), so the tie-break allocates nothing of the context's size.
        values, idx: ``logits.topk(count, sorted=True)``: ``[T, count]`` values (descending) and columns.

    Returns:
        ``[T, count]`` int64 columns: ``idx`` with the tied tail of each row replaced.
    """
    count = values.shape[1]
    kth = values[:, -1:]                                                       # [T, 1]
    num_above = (values > kth).sum(-1, keepdim=True)                           # strictly better: kept as they are
    tied_so_far = scratch.eq_(kth).cumsum_(-1)                                 # [T, S], non-decreasing
    # Entry j >= num_above of a row holds the k-th value: it takes the (j - num_above + 1)-th tied
    # column, the first column where the running count of tied columns reaches that number.
    tail = torch.arange(count, device=scratch.device) - num_above              # [T, count]
    wanted = (tail.clamp(min=0) + 1).to(scratch.dtype)
    nth_tied = torch.searchsorted(tied_so_far if tied_so_far.is_contiguous() else tied_so_far.contiguous(), wanted)
    return torch.where(tail >= 0, nth_tied, idx)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                   max_seq_len: int | None = None, *, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatching indexer logits (:func:`kernels.indexer_triton.indexer_scores_triton` or
    :func:`indexer_scores_ref`, same contract)."""
    if use_triton(q):
        from shardserve.kernels.indexer_triton import indexer_scores_triton

        return indexer_scores_triton(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len,
                                     q_scale=q_scale)
    return indexer_scores_ref(q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len,
                              q_scale=q_scale)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, topk: int, query_start_loc: torch.Tensor | None = None,
                 max_seq_len: int | None = None, *, q_scale: torch.Tensor | None = None, sink: int = 0,
                 query_start_host: list[int] | None = None, seq_lens_host: list[int] | None = None,
                 budget: int = WORKSPACE_ELEMENTS) -> torch.Tensor:
    """Top-k key positions per query token, scored in bounded row chunks.

    The rows are cut by :func:`kernels.workspace.plan_row_chunks` so that each chunk's logits
    ``[rows, width]`` hold at most ``budget`` float32 elements, ``width`` being the chunk's last
    causal position + 1 (decode: ``max_seq_len``); each chunk is scored (Triton on GPU, key tiles
    past a row's position skipped) and reduced to its top-k before the next one runs. Memory is
    ``O(budget + T x topk)`` whatever the context.

    Args:
        q, weights, k_cache, block_tables, seq_lens, query_start_loc, max_seq_len, q_scale: see
            :func:`indexer_scores_ref`.
        topk: keys kept per token.
        sink: first positions of each sequence always kept (see :func:`select_topk`).
        query_start_host, seq_lens_host: host copies of ``query_start_loc`` / ``seq_lens`` (prefill
            and mixed steps); read from the device when missing (a host sync).
        budget: logits per chunk (default :data:`kernels.workspace.WORKSPACE_ELEMENTS`).

    Returns:
        ``[T, topk]`` int32 positions (``-1`` padded), the input of the sparse
        :func:`kernels.mla_attention.mla_attention`.

    Raises:
        ValueError: see :func:`check_fp8_queries`.
    """
    check_fp8_queries(q, q_scale, k_cache)
    num_tokens = q.shape[0]
    width = _width(max_seq_len, block_tables, k_cache)
    if query_start_loc is not None and query_start_host is None:
        query_start_host, seq_lens_host = query_start_loc.tolist(), seq_lens.tolist()
    if query_start_loc is None:
        query_start_host = seq_lens_host = None
    chunks = plan_row_chunks(num_tokens, width, query_start_host, seq_lens_host, budget)
    token_seq, token_pos = token_seq_and_pos(query_start_loc, seq_lens, num_tokens)
    triton_rows = None
    if use_triton(q):
        from shardserve.kernels.indexer_triton import score_rows_triton as triton_rows
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=q.device)
    for chunk in chunks:
        rows = slice(chunk.start, chunk.end)
        args = (q[rows], weights[rows], k_cache, block_tables, token_seq[rows], token_pos[rows], chunk.width)
        scales = None if q_scale is None else q_scale[rows]
        if triton_rows is not None:
            logits = triton_rows(*args, q_scale=scales)
        else:
            logits = score_rows_ref(*args, chunk.segments, scales)
        out[rows] = select_topk(logits, topk, sink, consume=True)
        del logits                        # before the next chunk's: one chunk of logits alive at a time
    return out
