"""One step's packed tokens viewed per sequence: padding, cache gathers and the causal mask.

MLA and the DSA indexer both read a sequence's whole context back from a paged cache through its
block table and score each query token against it. :class:`PagedBatch` computes, once per forward,
where every packed token sits in a padded ``[B, Q]`` grid, which cache slots hold each sequence's
positions ``[B, S]``, and the causal mask ``[B, Q, S]``. Everything is per sequence: a query
never sees a slot of another sequence, and padding is masked (the multi-sequence top-k leak
seen in llama.cpp's first DSA port cannot happen by construction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.workers.forward_context import AttentionMetadata


@dataclass(slots=True)
class PagedBatch:
    """Per-sequence layout of one step. ``T`` packed tokens, ``B`` sequences, ``Q`` = max query
    length, ``S`` = max context length after this step."""

    seq_of_token: torch.Tensor | None   # [T] int64, sequence of each packed token
    row_of_token: torch.Tensor | None   # [T] int64, its row among that sequence's queries
    slots: torch.Tensor | None          # [B, S] int64, cache slot of each position (0 where not valid)
    causal: torch.Tensor | None         # [B, Q, S] bool, key position <= query position and < seq_len
    block_size: int
    max_query_len: int
    max_seq_len: int

    @classmethod
    def of_step(cls, meta: AttentionMetadata, block_size: int) -> PagedBatch:
        """:meth:`build`, once per step: kept in ``meta.step_cache`` for the step's other layers."""
        key = ("paged_batch", block_size)
        batch = meta.step_cache.get(key)
        if batch is None:
            batch = meta.step_cache[key] = cls.build(meta, block_size)
        return batch

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> PagedBatch:
        """Layout of the step described by ``meta`` over caches with ``block_size`` tokens per block.

        A decode step (one query per sequence) reads the caches through the decode kernels only,
        so its layout tensors stay None: they would be ``[B, S]`` over the whole context (and a
        captured decode graph sizes ``S`` by the longest allowed sequence).
        """
        device = meta.positions.device
        batch = meta.seq_lens.shape[0]
        if meta.max_query_len == 1:
            return cls(None, None, None, None, block_size, 1, meta.max_seq_len)
        num_tokens = meta.positions.shape[0]
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]                  # [B]
        seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
        row_of_token = torch.arange(num_tokens, device=device) - meta.query_start_loc[seq_of_token]
        pos = torch.arange(meta.max_seq_len, device=device)
        valid = pos[None, :] < meta.seq_lens[:, None]                                    # [B, S]
        block_idx = (pos // block_size).clamp(max=meta.block_tables.shape[1] - 1)
        slots = meta.block_tables[:, block_idx].long() * block_size + (pos % block_size)[None, :]
        slots = torch.where(valid, slots, 0)
        # Query row i of sequence b is at position seq_len - q_len + i (vLLM's convention).
        q_pos = (meta.seq_lens - q_lens)[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]
        causal = (pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]           # [B, Q, S]
        return cls(seq_of_token, row_of_token, slots, causal, block_size, meta.max_query_len, meta.max_seq_len)

    @property
    def batch_size(self) -> int:
        assert self.slots is not None, "a decode step's PagedBatch has no padded layout"
        return self.slots.shape[0]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...] -> [B, Q, ...]``, zeros in padded rows."""
        out = x.new_zeros(self.batch_size, self.max_query_len, *x.shape[1:])
        out[self.seq_of_token, self.row_of_token] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Q, ...] -> [T, ...]`` (drops padded rows)."""
        return x[self.seq_of_token, self.row_of_token]

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Each sequence's cached rows: ``cache [num_blocks, block_size, D] -> [B, S, D]``
        (rows at invalid positions are slot 0's content; mask them with :attr:`causal`)."""
        return cache.view(-1, cache.shape[-1])[self.slots]

