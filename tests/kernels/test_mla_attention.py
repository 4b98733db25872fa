"""Absorbed MLA attention (dense and top-k sparse): Triton vs reference, reference vs unabsorbed MHA."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id, paged_latent_rows, query_start_loc_of
from shardserve.kernels.mla_attention import mla_attention_ref

KV_LORA, ROPE = 32, 16

# (block_size, seq_lens, query_lens or None for decode, num_heads, num_splits)
DENSE = [
    (16, [1], None, 2, None),                  # a single token
    (16, [16, 17, 7], None, 4, None),          # decode on / one past a block boundary, odd length
    (64, [64, 65], None, 3, 2),                # block_size 64, odd head count, split-K
    (16, [150], None, 2, 3),                   # long context, 3 splits
    (16, [33, 5], [4, 5], 2, None),            # varlen: chunked prefill + full prefill
]


def build(block_size, seq_lens, query_lens, num_heads, dtype):
    """Per-sequence latent rows, paged into a cache of garbage, and absorbed queries."""
    cache, block_tables, rows = paged_latent_rows(seq_lens, block_size, KV_LORA + ROPE, dtype)
    num_tokens = len(seq_lens) if query_lens is None else sum(query_lens)
    q_nope = torch.randn(num_tokens, num_heads, KV_LORA, dtype=dtype)
    q_pe = torch.randn(num_tokens, num_heads, ROPE, dtype=dtype)
    qsl = None if query_lens is None else query_start_loc_of(query_lens)
    return q_nope, q_pe, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, rows


def token_positions(seq_lens, query_lens):
    """(sequence, position) of every packed query token."""
    query_lens = query_lens or [1] * len(seq_lens)
    return [(b, length - qlen + i) for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)) for i in range(qlen)]


@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,num_splits,dtype", [
    pytest.param(bs, lens, qlens, h, sp, dt,
                 id=case_id(len(lens), sum(qlens or [1] * len(lens)), h, KV_LORA, dt, f"bs{bs}", f"ctx{max(lens)}",
                            "varlen" if qlens else "decode", f"split{sp or 'auto'}"))
    for bs, lens, qlens, h, sp in DENSE for dt in DTYPES])
def test_mla_dense_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, num_splits, dtype):
    from shardserve.kernels.mla_attention_triton import mla_attention_triton

    q_nope, q_pe, cache, block_tables, lens, qsl, _ = build(block_size, seq_lens, query_lens, num_heads, dtype)
    scale = (KV_LORA + ROPE) ** -0.5
    expected = mla_attention_ref(q_nope, q_pe, cache, block_tables, lens, scale, qsl, max_seq_len=max(seq_lens))
    actual = mla_attention_triton(q_nope, q_pe, cache, block_tables, lens, scale, qsl, max_seq_len=max(seq_lens),
                                  num_splits=num_splits)
    assert actual.shape == (q_nope.shape[0], num_heads, KV_LORA) and actual.dtype == dtype
    assert_close(actual, expected, dtype)


def make_topk(seq_lens, query_lens, topk):
    """Random distinct positions of the token's sequence, ``-1``-padded (and shuffled) when fewer
    exist. In prefill some lie after the token's own position: attention must ignore them."""
    rows = []
    for b, _ in token_positions(seq_lens, query_lens):
        chosen = torch.randperm(seq_lens[b])[:topk]
        row = torch.cat([chosen, torch.full((topk - chosen.numel(),), -1)])
        rows.append(row[torch.randperm(topk)])
    return torch.stack(rows).to(torch.int32)


# (block_size, seq_lens, query_lens, num_heads, topk, num_splits); topk > valid keys in most rows.
SPARSE = [
    (16, [1, 17], None, 2, 8, None),           # one key only; one past a block boundary
    (64, [65, 130], None, 4, 64, 2),           # block_size 64, split over the top-k list
    (16, [20], [6], 2, 16, None),              # varlen prefill: early tokens have < topk keys
]


@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,topk,num_splits,dtype", [
    pytest.param(bs, lens, qlens, h, k, sp, dt,
                 id=case_id(len(lens), sum(qlens or [1] * len(lens)), h, KV_LORA, dt, f"bs{bs}", f"topk{k}",
                            f"split{sp or 'auto'}"))
    for bs, lens, qlens, h, k, sp in SPARSE for dt in DTYPES])
def test_mla_sparse_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, topk, num_splits, dtype):
    from shardserve.kernels.mla_attention_triton import mla_attention_triton

    q_nope, q_pe, cache, block_tables, lens, qsl, _ = build(block_size, seq_lens, query_lens, num_heads, dtype)
    topk_indices = make_topk(seq_lens, query_lens, topk)
    expected = mla_attention_ref(q_nope, q_pe, cache, block_tables, lens, 0.2, qsl, topk_indices)
    actual = mla_attention_triton(q_nope, q_pe, cache, block_tables, lens, 0.2, qsl, topk_indices,
                                  num_splits=num_splits)
    assert_close(actual, expected, dtype)


def test_mla_sparse_all_padding_row_is_zero():
    from shardserve.kernels.mla_attention_triton import mla_attention_triton

    q_nope, q_pe, cache, block_tables, lens, _, _ = build(16, [5, 9], None, 2, torch.float32)
    topk_indices = torch.tensor([[-1, -1, -1, -1], [8, -1, 0, 3]], dtype=torch.int32)
    expected = mla_attention_ref(q_nope, q_pe, cache, block_tables, lens, 0.2, None, topk_indices)
    assert torch.all(expected[0] == 0)
    assert_close(mla_attention_triton(q_nope, q_pe, cache, block_tables, lens, 0.2, None, topk_indices, num_splits=2),
                 expected, torch.float32)


@pytest.mark.parametrize("sparse", [False, True], ids=["B2-T5-H2-D32-fp32-dense", "B2-T5-H2-D32-fp32-sparse"])
def test_mla_reference_matches_unabsorbed_attention(sparse):
    """Absorbed MLA + W_UV == plain MHA with keys/values decompressed by W_UK / W_UV, masked densely."""
    seq_lens, query_lens, num_heads, nope_dim, v_dim = [17, 9], [3, 2], 2, 8, 12
    q_nope_raw_dtype = torch.float64
    _, _, cache, block_tables, lens, qsl, rows = build(16, seq_lens, query_lens, num_heads, torch.float32)
    w_uk = torch.randn(num_heads, KV_LORA, nope_dim, dtype=q_nope_raw_dtype)
    w_uv = torch.randn(num_heads, KV_LORA, v_dim, dtype=q_nope_raw_dtype)
    q_nope_raw = torch.randn(sum(query_lens), num_heads, nope_dim, dtype=q_nope_raw_dtype)
    q_pe = torch.randn(sum(query_lens), num_heads, ROPE, dtype=q_nope_raw_dtype)
    topk_indices = make_topk(seq_lens, query_lens, 6) if sparse else None
    scale = (nope_dim + ROPE) ** -0.5

    q_absorbed = torch.einsum("thn,hln->thl", q_nope_raw, w_uk)
    latent_out = mla_attention_ref(q_absorbed.float(), q_pe.float(), cache, block_tables, lens, scale, qsl,
                                   topk_indices)
    absorbed = torch.einsum("thl,hlv->thv", latent_out.double(), w_uv)

    expected = []
    for t, (b, pos) in enumerate(token_positions(seq_lens, query_lens)):
        latent, k_pe = rows[b][:, :KV_LORA].double(), rows[b][:, KV_LORA:].double()
        keys = torch.einsum("sl,hln->shn", latent, w_uk)                     # [S, H, nope]
        values = torch.einsum("sl,hlv->shv", latent, w_uv)                   # [S, H, v]
        scores = (torch.einsum("hn,shn->hs", q_nope_raw[t], keys) + torch.einsum("hr,sr->hs", q_pe[t], k_pe)) * scale
        allowed = torch.arange(seq_lens[b]) <= pos
        if sparse:
            chosen = torch.zeros(seq_lens[b], dtype=torch.bool)
            chosen[topk_indices[t][topk_indices[t] >= 0].long()] = True
            allowed &= chosen
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hs,shv->hv", probs, values))
    torch.testing.assert_close(absorbed, torch.stack(expected), atol=1e-4, rtol=1e-4)
