"""Bounded workspaces of the long-context kernels: how a step's rows are cut into chunks.

Prefill over a long context must not allocate anything of size ``tokens x context``: a
2,048-token chunk at 128K of context is 2.7e8 float32 logits (1 GiB) per layer for the DSA
indexer alone. The kernels here cut their work so that every temporary holds at most
:data:`WORKSPACE_ELEMENTS` elements (64 MiB in float32), whatever the context: the indexer
scores a few query rows against their whole causal context at a time (vLLM and DeepSeek's
reference chunk their prefill indexer the same way), the attention references walk key tiles
with an online softmax. The activation reserve of a step (``workers/plan.py``) is computed from
the same constant, so the profiled peak and the plan agree.

Host-side planning only (plain integers): the chunk bounds come from the step's host copies of
``query_start_loc`` / ``seq_lens``, so planning never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKSPACE_ELEMENTS = 1 << 24   # elements of one chunk's largest temporary (64 MiB in float32)


@dataclass(frozen=True, slots=True)
class RowChunk:
    """Packed query rows ``start..end-1`` scored together against key positions ``0..width-1``."""

    start: int                     # first packed row
    end: int                       # one past the last row
    width: int                     # key positions scored (max causal position of the rows + 1)
    # (first_row, end_row, sequence, num_keys) runs of rows of one sequence, absolute rows, seeing
    # keys 0..num_keys-1 at most; None in decode steps, where row t is sequence t's last position
    # (and its length is not known on the host).
    segments: tuple[tuple[int, int, int, int], ...] | None


def _rows_that_fit(rows: int, width: int, first_pos: int, remaining: int, budget: int) -> int:
    """Largest ``n <= remaining`` with ``(rows + n) * max(width, first_pos + n) <= budget``
    (rows ``first_pos..first_pos+n-1`` see ``first_pos + n`` keys at most)."""
    def cost(n: int) -> int:
        return (rows + n) * max(width, first_pos + n)

    if cost(remaining) <= budget:
        return remaining
    low, high = 0, remaining          # cost(low) <= budget < cost(high)
    while high - low > 1:
        mid = (low + high) // 2
        if cost(mid) <= budget:
            low = mid
        else:
            high = mid
    return low


def plan_row_chunks(num_tokens: int, max_width: int, query_start: list[int] | None = None,
                    seq_lens: list[int] | None = None, budget: int = WORKSPACE_ELEMENTS) -> list[RowChunk]:
    """Cut a step's packed query rows into chunks whose ``rows x width`` stays within ``budget``.

    Args:
        num_tokens: packed query rows ``T``.
        max_width: upper bound on any row's key count (the step's ``max_seq_len``, at most the
            block table's capacity).
        query_start: host ``[B + 1]`` cumulative query counts; None for a decode step (row t is the
            last position of sequence t).
        seq_lens: host ``[B]`` context lengths after the step (with ``query_start``).
        budget: elements per chunk; a single row wider than the budget still forms a chunk.

    Returns:
        chunks in row order covering ``0..T-1``. Prefill rows see only their causal keys, so a
        chunk's width is its last position + 1: early rows of a long prompt share a chunk, late
        ones do not (the causal half of the work is never scored).
    """
    if query_start is None:
        rows = max(1, budget // max(1, max_width))
        return [RowChunk(start, min(start + rows, num_tokens), max_width, None)
                for start in range(0, num_tokens, rows)]
    assert seq_lens is not None and len(query_start) == len(seq_lens) + 1 and query_start[-1] == num_tokens, \
        f"query_start {query_start[:4]}... / seq_lens {seq_lens[:4]}... do not describe {num_tokens} rows"
    chunks: list[RowChunk] = []
    start, width, segments = 0, 0, []

    def close(end: int) -> None:
        nonlocal start, width, segments
        if end > start:
            chunks.append(RowChunk(start, end, min(width, max_width), tuple(segments)))
        start, width, segments = end, 0, []

    for seq, (first_row, end_row) in enumerate(zip(query_start[:-1], query_start[1:])):
        first_pos = seq_lens[seq] - (end_row - first_row)
        row = first_row
        while row < end_row:
            pos = first_pos + row - first_row
            count = _rows_that_fit(row - start, width, pos, end_row - row, budget)
            if count == 0:
                if row == start:      # one row alone is wider than the budget: it still runs
                    count = 1
                else:
                    close(row)
                    continue
            segments.append((row, row + count, seq, pos + count))
            width = max(width, pos + count)
            row += count
            if row < end_row:
                close(row)
    close(num_tokens)
    return chunks
