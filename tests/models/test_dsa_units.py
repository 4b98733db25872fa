"""Unit checks of the DSA pieces: Hadamard rotation, per-sequence layout, top-k isolation."""

from __future__ import annotations

import pytest
import torch

from shardserve.workers.forward_context import AttentionMetadata
from shardserve.kernels import indexer_topk
from shardserve.workers.models.dsa_indexer import hadamard_transform, selection_mask
from shardserve.workers.models.mla import mla_softmax_scale
from shardserve.workers.models.paged_batch import PagedBatch


def _sylvester(dim: int) -> torch.Tensor:
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < dim:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix / dim ** 0.5


@pytest.mark.parametrize("dim", [1, 2, 8, 128])
def test_hadamard_is_the_normalized_sylvester_matrix(dim):
    x = torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(dim))
    assert torch.allclose(hadamard_transform(x), x @ _sylvester(dim), atol=1e-5)
    # Orthonormal: dot products (indexer scores) are preserved.
    y = torch.randn(7, dim, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(hadamard_transform(x) @ hadamard_transform(y).T, x @ y.T, atol=1e-4)


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.zeros(2, 48))


def _two_sequences() -> tuple[PagedBatch, AttentionMetadata]:
    """Sequence 0: 3 cached + 2 new tokens in blocks [5, 1]; sequence 1: 6 new tokens in [0, 3]."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5 * 4 + 3, 1 * 4 + 0, 0, 1, 2, 3, 12, 13]),
        positions=torch.tensor([3, 4, 0, 1, 2, 3, 4, 5]),
        query_start_loc=torch.tensor([0, 2, 8]),
        seq_lens=torch.tensor([5, 6]),
        block_tables=torch.tensor([[5, 1], [0, 3]], dtype=torch.int32),
        max_query_len=6, max_seq_len=6)
    return PagedBatch.build(meta, block_size=4), meta


def test_paged_batch_host_bounds_and_dense_groups():
    """Host bounds come from the metadata's host copies (no device read), or from the device when a
    builder has none; dense groups route long query chunks to the expanded form, short ones to the
    absorbed form, each as a sub-batch of its own rows, sequences and block tables."""
    batch, meta = _two_sequences()
    assert (batch.query_start, batch.seq_lens, batch.query_lens) == ([0, 2, 8], [5, 6], [2, 6])
    meta.query_start_host, meta.seq_lens_host = [0, 2, 8], [5, 6]
    meta.query_start_loc = meta.seq_lens = None                # must not be read
    assert PagedBatch.build(meta, block_size=4).query_start == [0, 2, 8]
    batch, meta = _two_sequences()
    # kv_lora 32, nope 16, rope 16, v 24 (the tiny checkpoints): expanded from 54 query tokens on.
    assert [(g.expanded, g.token_idx) for g in batch.dense_groups(32, 16, 16, 24)] == [(False, None)]
    # kv_lora 8, nope 2, rope 1, v 2: expanded from 3 query tokens on (q_lens 2 and 6 split).
    expanded, absorbed = batch.dense_groups(8, 2, 1, 2)
    assert (expanded.expanded, expanded.token_idx.tolist(), expanded.seq_lens_host) == (True, [2, 3, 4, 5, 6, 7], [6])
    assert (absorbed.expanded, absorbed.token_idx.tolist(), absorbed.seq_lens_host) == (False, [0, 1], [5])
    assert batch.dense_groups(8, 2, 1, 2) is batch.dense_groups(8, 2, 1, 2)     # built once per step


def test_dense_groups_split_a_mixed_step():
    """A decode token (q_len 1) and a prefill chunk (q_len 6) in one step: two sub-batches."""
    meta = AttentionMetadata(slot_mapping=torch.arange(7), positions=torch.tensor([9, 0, 1, 2, 3, 4, 5]),
                             query_start_loc=torch.tensor([0, 1, 7]), seq_lens=torch.tensor([10, 6]),
                             block_tables=torch.tensor([[2, 4, 6], [1, 3, 0]], dtype=torch.int32),
                             max_query_len=6, max_seq_len=10)
    expanded, absorbed = PagedBatch.build(meta, block_size=4).dense_groups(8, 2, 1, 2)
    assert (expanded.token_idx.tolist(), expanded.query_start_host, expanded.seq_lens_host) == \
        ([1, 2, 3, 4, 5, 6], [0, 6], [6])
    assert expanded.block_tables.tolist() == [[1, 3, 0]] and expanded.query_start_loc.tolist() == [0, 6]
    assert (absorbed.token_idx.tolist(), absorbed.seq_lens.tolist(), absorbed.max_seq_len) == ([0], [10], 10)


def test_topk_never_selects_another_sequence_or_a_future_key():
    """Keys that would win by far but that a query must not see (another sequence's blocks, its
    own future positions, slots past its length) are never selected; a query with fewer than k
    visible keys keeps all of them and pads with -1."""
    _, meta = _two_sequences()
    gen = torch.Generator().manual_seed(0)
    k_cache = 0.01 * torch.randn(6, 4, 8, generator=gen)
    k_cache[1, 1:] = 100.0                         # sequence 0's slots past its length (positions 5..7)
    k_cache[0] = k_cache[3] = 50.0                 # sequence 1's blocks
    k_cache[3, 1] = 1000.0                         # sequence 1's position 5: the future for its early queries
    q = torch.ones(8, 2, 8)
    weights = torch.ones(8, 2)
    for budget in (1, 6, 1 << 20):                 # one row per chunk, a few rows, all rows at once
        topk = indexer_topk(q, weights, k_cache, meta.block_tables, meta.seq_lens, 3, meta.query_start_loc,
                            meta.max_seq_len, budget=budget)                       # [8, 3]
        picked = selection_mask(topk, 6)                                           # [T, S]
        visible = torch.arange(6)[None, :] <= meta.positions[:, None]              # causal, own sequence
        assert not (picked & ~visible).any()
        assert picked.sum(-1).tolist() == [3, 3, 1, 2, 3, 3, 3, 3]
        assert topk[2].tolist() == [0, -1, -1]          # sequence 1's first query: only itself
        assert topk[7, 0].item() == 5                   # its last query does see position 5


def test_softmax_scale_yarn_mscale():
    class Config:
        qk_nope_head_dim, qk_rope_head_dim = 128, 64
        rope_parameters = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}

    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert mla_softmax_scale(Config()) == pytest.approx(192 ** -0.5 * mscale ** 2)
    Config.rope_parameters = {"rope_type": "default"}
    assert mla_softmax_scale(Config()) == pytest.approx(192 ** -0.5)
