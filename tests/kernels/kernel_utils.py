"""Helpers shared by the kernel tests: tolerances, ids, paged-cache builders."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16]

# (atol, rtol) per dtype. fp32: kernels and references differ only in summation order. bf16:
# the reference rounds intermediates to bf16 and Triton's interpreter truncates (not rounds)
# fp32 -> bf16 casts, so 1-2 bf16 ulps (2**-8 relative each) are expected.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` for test ids."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def case_id(batch: int, num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, *extra: str) -> str:
    """Test id ``B{}-T{}-H{}-D{}-{dtype}`` plus optional ``-extra`` tags."""
    return "-".join([f"B{batch}-T{num_tokens}-H{num_heads}-D{head_dim}-{dtype_name(dtype)}", *extra])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """``torch.testing.assert_close`` in float32 with this dtype's tolerances times ``scale``."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale)


def make_block_tables(seq_lens: list[int], block_size: int, extra_blocks: int = 3) -> tuple[torch.Tensor, int]:
    """Random, non-overlapping physical blocks for each sequence (padded with block 0).

    Returns:
        ``block_tables [B, max_blocks]`` int32 and ``num_blocks`` in the pool.
    """
    blocks_per_seq = [max(1, -(-length // block_size)) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks)
    max_blocks = max(blocks_per_seq) + 1  # one unused column, as a real table has
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for b, count in enumerate(blocks_per_seq):
        block_tables[b, :count] = perm[start:start + count].to(torch.int32)
        start += count
    return block_tables, num_blocks


def slots_of(block_tables: torch.Tensor, seq: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` of sequence ``seq`` (int64)."""
    return block_tables[seq, positions // block_size].long() * block_size + positions % block_size


def query_start_loc_of(query_lens: list[int]) -> torch.Tensor:
    """``[B + 1]`` int32 cumulative query counts."""
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)


def paged_latent_rows(seq_lens: list[int], block_size: int, row_width: int, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Random per-sequence rows paged into a cache of garbage (MLA latent rows).

    Returns:
        ``cache [num_blocks, block_size, row_width]``, ``block_tables [B, max_blocks]`` int32 and
        the rows of each sequence ``[len_b, row_width]``.
    """
    from shardserve.kernels.paged_attention import store_cache_ref

    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    cache = torch.randn(num_blocks, block_size, row_width, dtype=dtype)
    rows = [torch.randn(length, row_width, dtype=dtype) for length in seq_lens]
    for b, length in enumerate(seq_lens):
        store_cache_ref(rows[b], cache, slots_of(block_tables, b, torch.arange(length), block_size))
    return cache, block_tables, rows
