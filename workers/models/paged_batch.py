"""One step's sequences as the MLA / DSA prefill kernels need them: host bounds and dense groups.

A prefill (or mixed, or verify) step packs several sequences' query tokens. The long-context
kernels plan bounded chunks from plain host integers (where each sequence's queries start, how
long its context is), so :class:`PagedBatch` carries those once per forward, from the step's host
copies (no device read). Dense MLA additionally routes each sequence to the cheaper of two exact
forms (:func:`kernels.mla_prefill.expanded_is_cheaper`): long query chunks expanded per key chunk,
short ones (decode tokens riding along, speculative verification) absorbed;
:meth:`PagedBatch.dense_groups` gives each form its sequences as a sub-batch, built once per step.

Nothing here is of size ``tokens x context``: every kernel reads each sequence's own cache rows
through its block table, so a query never sees a slot of another sequence (the multi-sequence
top-k leak of llama.cpp's first DSA port cannot happen by construction).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardserve.kernels.mla_prefill import expanded_is_cheaper
from shardserve.workers.forward_context import AttentionMetadata


@dataclass(slots=True)
class SeqGroup:
    """Some sequences of a step, as a batch of their own (tensors on the step's device)."""

    expanded: bool                       # dense MLA form: expanded per key chunk (else absorbed)
    token_idx: torch.Tensor | None       # [T_g] int64 packed rows of the step; None = all rows, in order
    query_start_loc: torch.Tensor        # [B_g + 1]
    seq_lens: torch.Tensor               # [B_g]
    block_tables: torch.Tensor           # [B_g, max_blocks] int32
    query_start_host: list[int]          # host copy of query_start_loc
    seq_lens_host: list[int]             # host copy of seq_lens
    max_seq_len: int


@dataclass(slots=True)
class PagedBatch:
    """Host view of one step. ``B`` sequences; decode steps (one query each) keep no host lists."""

    meta: AttentionMetadata
    query_start: list[int] | None        # [B + 1] host cu_seqlens (None in decode steps)
    seq_lens: list[int] | None           # [B] host context lengths after the step (None in decode steps)
    block_size: int
    max_query_len: int
    max_seq_len: int
    _groups: dict = field(default_factory=dict)

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
        """The layout of the step described by ``meta`` over caches of ``block_size`` tokens per block.

        Host lists come from ``meta``'s host copies; a builder without them (tests, the profiler of
        other models) costs one device read here, once per forward, never in a decode step.
        """
        if meta.max_query_len == 1:
            return cls(meta, None, None, block_size, 1, meta.max_seq_len)
        query_start = meta.query_start_host if meta.query_start_host is not None else meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist()
        return cls(meta, list(query_start), list(seq_lens), block_size, meta.max_query_len, meta.max_seq_len)

    @property
    def query_lens(self) -> list[int]:
        assert self.query_start is not None, "a decode step has one query per sequence"
        return [end - first for first, end in zip(self.query_start[:-1], self.query_start[1:])]

    def dense_groups(self, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int) -> list[SeqGroup]:
        """The step's sequences split by dense MLA form (:func:`kernels.mla_prefill.expanded_is_cheaper`
        with these ranks): one group when all agree (``token_idx`` None), else two, expanded first."""
        key = (kv_lora_rank, nope_dim, rope_dim, v_dim)
        if key not in self._groups:
            expands = [expanded_is_cheaper(q_len, *key) for q_len in self.query_lens]
            self._groups[key] = [self._group(flag, [b for b, e in enumerate(expands) if e == flag], len(expands))
                                 for flag in (True, False) if flag in expands]
        return self._groups[key]

    def _group(self, expanded: bool, seqs: list[int], num_seqs: int) -> SeqGroup:
        meta = self.meta
        if len(seqs) == num_seqs:
            return SeqGroup(expanded, None, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                            self.query_start, self.seq_lens, self.max_seq_len)
        rows = [row for b in seqs for row in range(self.query_start[b], self.query_start[b + 1])]
        query_start = [0]
        for b in seqs:
            query_start.append(query_start[-1] + self.query_start[b + 1] - self.query_start[b])
        seq_lens = [self.seq_lens[b] for b in seqs]
        device = meta.query_start_loc.device
        index = _upload(seqs + rows + query_start, device)
        seq_idx, token_idx, qsl = index.split([len(seqs), len(rows), len(query_start)])
        return SeqGroup(expanded, token_idx, qsl, meta.seq_lens[seq_idx], meta.block_tables[seq_idx],
                        query_start, seq_lens, max(seq_lens))


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device`` without waiting for the device (pinned copy)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
