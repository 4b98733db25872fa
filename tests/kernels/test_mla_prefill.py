"""Dense MLA prefill expanded per key chunk: reference and Triton vs a materialized float64 oracle,
with chunks small enough that every softmax spans several of them; the bounded absorbed reference
across key tiles; where the expanded form takes over."""

from __future__ import annotations

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id, make_block_tables, paged_latent_rows, query_start_loc_of, slots_of
from shardserve.kernels.mla_attention import mla_attention_ref
from shardserve.kernels.mla_prefill import expanded_is_cheaper, mla_prefill_dense

KV_LORA, ROPE, NOPE, V = 32, 16, 16, 24


def build(block_size, seq_lens, query_lens, num_heads, dtype):
    """Latent rows paged into a cache of garbage, queries, and a kv_b weight ``[H, nope + v, L]``."""
    cache, block_tables, rows = paged_latent_rows(seq_lens, block_size, KV_LORA + ROPE, dtype)
    num_tokens = sum(query_lens)
    q_nope = torch.randn(num_tokens, num_heads, NOPE, dtype=dtype)
    q_pe = torch.randn(num_tokens, num_heads, ROPE, dtype=dtype)
    w_kv = (torch.randn(num_heads, NOPE + V, KV_LORA) * KV_LORA ** -0.5).to(dtype)
    return q_nope, q_pe, cache, block_tables, rows, w_kv


def oracle(q_nope, q_pe, rows, w_kv, seq_lens, query_lens, scale) -> torch.Tensor:
    """Float64, per sequence: expand the whole context, materialize ``[H, Q, S]`` scores, causal mask."""
    outs, start = [], 0
    for b, (length, q_len) in enumerate(zip(seq_lens, query_lens)):
        latent, k_pe = rows[b].double().split([KV_LORA, ROPE], dim=-1)
        kv = torch.einsum("sl,hdl->shd", latent, w_kv.double())
        k_nope, value = kv.split([NOPE, V], dim=-1)
        qn, qp = q_nope[start:start + q_len].double(), q_pe[start:start + q_len].double()
        scores = (torch.einsum("qhn,shn->hqs", qn, k_nope) + torch.einsum("qhr,sr->hqs", qp, k_pe)) * scale
        q_pos = torch.arange(length - q_len, length)
        scores = scores.masked_fill(torch.arange(length)[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqs,shv->qhv", scores.softmax(-1), value))
        start += q_len
    return torch.cat(outs)


# (block_size, seq_lens, query_lens, num_heads, budget): budget 1 = one block_size chunk of keys.
CASES = [
    (16, [40], [40], 2, 1),                    # one sequence, prefill from 0, chunks of 16 keys
    (16, [100, 7], [30, 7], 3, 1),             # cached prefix of 70 + a fresh short prompt, odd heads
    (4, [33, 9, 20], [33, 1, 5], 2, 1),        # block_size 4 (chunks of 4), a decode-sized query
    (16, [90], [70], 2, 1 << 24),              # one chunk holds the whole context
]


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,budget,dtype", [
    pytest.param(bs, lens, qlens, h, budget, dt,
                 id=case_id(len(lens), sum(qlens), h, KV_LORA, dt, f"bs{bs}", f"ctx{max(lens)}",
                            "chunked" if budget == 1 else "one-chunk"))
    for bs, lens, qlens, h, budget in CASES for dt in DTYPES])
def test_expanded_prefill_matches_materialized_attention(block_size, seq_lens, query_lens, num_heads, budget,
                                                         dtype, path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_KERNELS", path)
    q_nope, q_pe, cache, block_tables, rows, w_kv = build(block_size, seq_lens, query_lens, num_heads, dtype)
    scale = (NOPE + ROPE) ** -0.5
    qsl = query_start_loc_of(query_lens)
    out = mla_prefill_dense(q_nope, q_pe, cache, block_tables, torch.tensor(seq_lens), qsl, w_kv, scale,
                            query_start_host=qsl.tolist(), seq_lens_host=list(seq_lens), budget=budget)
    assert out.shape == (sum(query_lens), num_heads, V) and out.dtype == dtype
    expected = oracle(q_nope, q_pe, rows, w_kv, seq_lens, query_lens, scale)
    # bf16: the expanded keys and values are rounded to bf16 before attention (as on the GPU).
    assert_close(out, expected, dtype, scale=1.0 if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk300"])
def test_absorbed_reference_is_exact_across_key_tiles(sparse):
    """The absorbed reference walks 256-key tiles with an online softmax: a 600-key context (and a
    300-key selection) gives the single-softmax result of the unabsorbed attention."""
    seq_lens, query_lens, num_heads = [600, 300], [3, 2], 2
    block_tables, num_blocks = make_block_tables(seq_lens, 16)
    cache = torch.randn(num_blocks, 16, KV_LORA + ROPE)
    q_nope, q_pe = torch.randn(5, num_heads, KV_LORA), torch.randn(5, num_heads, ROPE)
    qsl, lens = query_start_loc_of(query_lens), torch.tensor(seq_lens)
    topk = None
    if sparse:
        topk = torch.stack([torch.randperm(seq_lens[b])[:300] for b in (0, 0, 0, 1, 1)]).to(torch.int32)
    out = mla_attention_ref(q_nope, q_pe, cache, block_tables, lens, 0.1, qsl, topk, max_seq_len=600)
    t = 0
    for b, (length, q_len) in enumerate(zip(seq_lens, query_lens)):
        slots = slots_of(block_tables, b, torch.arange(length), 16)
        rows = cache.view(-1, KV_LORA + ROPE)[slots].double()
        for i in range(q_len):
            pos = length - q_len + i
            keys = torch.arange(pos + 1) if topk is None else topk[t][topk[t] <= pos].long()
            scores = (rows[keys, :KV_LORA] @ q_nope[t].double().T + rows[keys, KV_LORA:] @ q_pe[t].double().T) * 0.1
            expected = scores.softmax(0).T @ rows[keys, :KV_LORA]                              # [H, L]
            torch.testing.assert_close(out[t].double(), expected, atol=1e-5, rtol=1e-5)
            t += 1


def test_expanded_form_takes_over_for_long_query_chunks():
    # DeepSeek-V3 / V3.2 ranks: absorbed up to 170 query tokens of a sequence, expanded from 171.
    assert not expanded_is_cheaper(170, 512, 128, 64, 128) and expanded_is_cheaper(171, 512, 128, 64, 128)
    # The tiny test checkpoints: from 54.
    assert not expanded_is_cheaper(53, KV_LORA, NOPE, ROPE, V) and expanded_is_cheaper(54, KV_LORA, NOPE, ROPE, V)
    # A latent no wider than the heads: the absorbed form is never dearer.
    assert not expanded_is_cheaper(10 ** 6, 16, 16, 8, 16)
