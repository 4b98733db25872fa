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



def test_verify_rows_select_what_decode_steps_select(tiny_model):
    """A query scored as a row of a 4-row verify chunk keeps the DSA top-k, and gets the logits, it
    gets alone in a decode step over the same cache, also where keys tie exactly at the top-k
    boundary: with 2 indexer heads left (the others' weights zeroed) a key that neither scores
    positively has logit exactly 0 (``relu``), and ``torch.topk`` breaks such ties by the tensor's
    shape. Before ties went to the lowest positions, verify rows kept other tied keys than decode
    did, and MTP-verified greedy output left plain greedy decoding (issue 31)."""
    from plan_driver import PlanDriver, make_runner, recorded_indexer_calls

    from shardserve.kernels.indexer import indexer_scores_ref

    runner = make_runner(tiny_model("deepseek_v32").path, block_size=4, num_blocks=48)
    layers = [layer for layer in runner.model.attention_layers() if layer.indexer is not None]
    for layer in layers:
        layer.record_topk = True
        with torch.no_grad():
            layer.indexer.weights_proj.weight[2:] = 0.0
    gen = torch.Generator().manual_seed(0)
    prompt, tail = torch.randint(0, 128, (20,), generator=gen).tolist(), torch.randint(0, 128, (8,), generator=gen)
    driver = PlanDriver(runner)
    driver.step({"decode": prompt, "verify": prompt})
    decode_topk, decode_logits = [], []
    for token in tail.tolist():
        decode_logits.append(driver.step({"decode": [token]})["decode"])
        decode_topk.append(torch.stack([layer.last_topk[0] for layer in layers]))       # [layers, k]
    verify_topk, verify_logits, tied_rows = [], [], 0
    for chunk in tail.view(2, 4).tolist():                     # two verify steps of 1 + 3 drafts
        with recorded_indexer_calls() as calls:
            verify_logits.append(driver.step_all_rows({"verify": chunk})["verify"])
        verify_topk += torch.stack([layer.last_topk for layer in layers], 1).unbind()  # 4 x [layers, k]
        for (q, weights, k_cache, block_tables, seq_lens, top_k, *rest), _ in calls:
            scores = indexer_scores_ref(q, weights, k_cache, block_tables, seq_lens, *rest)    # [4, S]
            best = scores.topk(top_k).values                                            # [4, k]
            tied_rows += int(((scores == best[:, -1:]).sum(-1) > (best == best[:, -1:]).sum(-1)).sum())
    assert tied_rows, "no exact tie straddles the top-k boundary: the test checks nothing"
    for row, (decode, verify) in enumerate(zip(decode_topk, verify_topk)):    # the same keys (order: float rounding)
        assert torch.equal(decode.sort(-1).values, verify.sort(-1).values), (row, decode, verify)
    decode_logits, verify_logits = torch.stack(decode_logits), torch.cat(verify_logits)
    torch.testing.assert_close(verify_logits, decode_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(verify_logits.argmax(-1), decode_logits.argmax(-1))
