"""DSA indexer: Triton logits vs reference (float / fp8 keys / fp8 keys and queries), top-k selection
with and without the per-sequence attention sink, reference vs a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_utils import DTYPES, assert_close, case_id, make_block_tables, query_start_loc_of, slots_of
from shardserve.kernels.indexer import (dequantize_index_keys, dequantize_index_queries, fp8_row_bytes,
                                        indexer_scores, indexer_scores_ref, indexer_topk, quantize_index_keys,
                                        quantize_index_queries, select_topk)
from shardserve.kernels.paged_attention import store_cache_ref
from shardserve.kernels.workspace import plan_row_chunks

# (block_size, seq_lens, query_lens or None for decode, num_heads, head_dim)
CASES = [
    (16, [1], None, 2, 32),                    # a single token
    (16, [16, 17, 5], None, 4, 32),            # block boundary and one past it, odd length
    (64, [64, 65], None, 3, 64),               # block_size 64
    (16, [40, 7], [5, 7], 2, 32),              # varlen: chunked prefill + full prefill
    (16, [70], None, 80, 16),                  # more heads than one head tile (two tiles of 64)
    (16, [20, 9], [4, 9], 2, 200),             # two fp8 scale groups, the second one partial
]


def build(block_size, seq_lens, query_lens, num_heads, head_dim, dtype):
    block_tables, num_blocks = make_block_tables(seq_lens, block_size)
    k_cache = torch.randn(num_blocks, block_size, head_dim, dtype=dtype)
    keys = [torch.randn(length, head_dim, dtype=dtype) for length in seq_lens]
    for b, length in enumerate(seq_lens):
        store_cache_ref(keys[b], k_cache, slots_of(block_tables, b, torch.arange(length), block_size))
    num_tokens = len(seq_lens) if query_lens is None else sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    weights = torch.randn(num_tokens, num_heads) * num_heads ** -0.5
    qsl = None if query_lens is None else query_start_loc_of(query_lens)
    return q, weights, k_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, keys


def params():
    for bs, lens, qlens, h, d in CASES:
        for dtype in DTYPES:
            num_tokens = sum(qlens) if qlens else len(lens)
            yield pytest.param(bs, lens, qlens, h, d, dtype,
                               id=case_id(len(lens), num_tokens, h, d, dtype, f"bs{bs}", f"ctx{max(lens)}"))


@pytest.mark.parametrize("cache", ["model-dtype", "fp8", "fp8-queries"])
@pytest.mark.parametrize("block_size,seq_lens,query_lens,num_heads,head_dim,dtype", list(params()))
def test_indexer_kernel_matches_reference(block_size, seq_lens, query_lens, num_heads, head_dim, dtype, cache):
    from shardserve.kernels.indexer_triton import indexer_scores_triton

    make = build if cache == "model-dtype" else build_fp8
    q, weights, k_cache, block_tables, lens, qsl, _ = make(block_size, seq_lens, query_lens, num_heads, head_dim,
                                                            dtype)
    q_scale = None
    if cache == "fp8-queries":
        q, q_scale = quantize_index_queries(q)
    expected = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens), q_scale=q_scale)
    actual = indexer_scores_triton(q, weights, k_cache, block_tables, lens, qsl, max(seq_lens), q_scale=q_scale)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "causal -inf pattern differs"
    finite = torch.isfinite(expected)
    # Model-dtype keys: logits sum H*D products and bf16 inputs are exact in fp32, so both dtypes use
    # the fp32-level bound. fp8 keys: the kernel multiplies dequantized keys rounded to the query's
    # dtype (the tensor-core operand dtype), so the bound is that dtype's. fp8 keys and queries:
    # products of e4m3 values are exact, so only the summation order differs (fp32 bound).
    bound = dtype if cache == "fp8" else torch.float32
    assert_close(actual[finite], expected[finite], bound, scale=5.0)


@pytest.mark.parametrize("topk", [4, 64, 2048], ids=["B2-T12-H4-D32-fp32-topk4", "B2-T12-H4-D32-fp32-topk64-exceeds",
                                                     "B2-T12-H4-D32-fp32-topk2048-deepseek"])
def test_indexer_topk_kernel_selects_reference_best(topk, monkeypatch):
    """Top-k through the Triton logits picks keys the reference also ranks in its top-k."""
    q, weights, k_cache, block_tables, lens, qsl, _ = build(16, [40, 7], [5, 7], 4, 32, torch.float32)
    expected_logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 40)
    monkeypatch.setenv("SHARDSERVE_KERNELS", "triton")
    chosen = indexer_topk(q, weights, k_cache, block_tables, lens, topk, qsl, 40)
    assert chosen.shape == (12, topk) and chosen.dtype == torch.int32
    num_valid = torch.isfinite(expected_logits).sum(-1)                          # [T]
    for t in range(12):
        picked = chosen[t][chosen[t] >= 0].long()
        assert picked.numel() == min(topk, int(num_valid[t])), (t, picked)
        assert torch.all(chosen[t][picked.numel():] == -1), "padding must trail"
        kth_best = expected_logits[t].topk(picked.numel()).values[-1]
        assert torch.all(expected_logits[t][picked] >= kth_best - 1e-4), (t, picked)


def test_select_topk_pads_rows_with_few_keys():
    inf = float("-inf")
    logits = torch.tensor([[0.5, inf, inf], [0.1, 0.9, 0.3], [inf, inf, inf]])
    assert select_topk(logits, 2).tolist() == [[0, -1], [1, 2], [-1, -1]]
    assert select_topk(logits, 5).tolist() == [[0, -1, -1, -1, -1], [1, 2, 0, -1, -1], [-1, -1, -1, -1, -1]]
    assert select_topk(logits[:, :0], 3).tolist() == [[-1] * 3] * 3
    tied = torch.tensor([[0.0, 0.0, 3.0, 0.0, -1.0, 0.0, inf], [1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    assert select_topk(tied, 3).tolist() == [[2, 0, 1], [3, 0, 1]]           # exact ties: lowest positions
    assert select_topk(tied, 3, sink=1).tolist() == [[0, 2, 1], [0, 3, 1]]


def per_token_logits(q, weights, keys, seq_lens, query_lens, width) -> torch.Tensor:
    """Float64 oracle: for each packed query token, a loop over its own sequence's visible keys
    (``keys[b]`` ``[len_b, D]``); ``-inf`` after the token's position."""
    naive = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float64)
    t = 0
    for b, (length, qlen) in enumerate(zip(seq_lens, query_lens)):
        for i in range(qlen):
            pos = length - qlen + i
            for s in range(pos + 1):
                dots = q[t].double() @ keys[b][s].double()                        # [H]
                naive[t, s] = (weights[t].double() * dots.clamp(min=0)).sum()
            t += 1
    return naive


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([18, 33], [3, 4]),                    # verify rows only: every run short, scored as decode rows
    ([40, 9, 21, 50], [12, 1, 3, 9]),      # a mixed step: prefill chunks (> 8 rows) beside short runs
    ([24], [24]),                          # one prefill
], ids=["short-runs", "mixed", "prefill"])
def test_indexer_reference_matches_per_token_loop(seq_lens, query_lens):
    q, weights, k_cache, block_tables, lens, qsl, keys = build(16, seq_lens, query_lens, 3, 16, torch.float32)
    width = max(seq_lens)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, width)
    torch.testing.assert_close(logits.double(), per_token_logits(q, weights, keys, seq_lens, query_lens, width),
                               atol=1e-5, rtol=1e-5)

# ---- fp8 key cache (DeepSeek-V3.2 format: e4m3 values + a power-of-two float32 scale per 128 dims)

def _ue8m0_scale(amax: float) -> float:
    """DeepSeek-V3.2 ``act_quant(scale_fmt="ue8m0")``: ``amax`` floored at 1e-4, times float32
    ``1/448`` in float32, rounded up to a power of two (exactly, with ``math.frexp``)."""
    ratio = float(torch.tensor(max(amax, 1e-4), dtype=torch.float32) * torch.tensor(1 / 448.0))
    mantissa, exponent = math.frexp(ratio)                       # ratio = mantissa * 2**exponent, [0.5, 1)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def _fp8_oracle(row: torch.Tensor) -> torch.Tensor:
    """One key row quantized and dequantized group by group with plain Python scalars."""
    out = torch.empty(row.shape[0], dtype=torch.float32)
    for start in range(0, row.shape[0], 128):
        group = row[start:start + 128].float()
        scale = _ue8m0_scale(float(group.abs().max()))
        out[start:start + 128] = (group / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out


def test_fp8_scales_round_up_to_a_power_of_two_exactly():
    """Group maxima at, just above and just below ``448 * 2**e``, and under act_quant's 1e-4 floor:
    the scale is DeepSeek's ``fast_round_scale`` (a float ``log2`` of ``(1 + 2**-23) * 2**e`` rounds
    to ``e`` and halved the scale before)."""
    maxima = [448.0 * 2.0 ** e * m for e in range(-20, 10) for m in (1.0, 1 + 2 ** -23, 1 + 2 ** -22, 1 - 2 ** -24)]
    maxima += [1e-4, 5e-5, 1e-7, 0.0]
    rows = torch.zeros(len(maxima), 32)
    rows[:, 3] = torch.tensor(maxima)
    rows[:, 4] = -0.3 * rows[:, 3]
    values, scale = quantize_index_queries(rows[:, None, :])
    assert scale[:, 0, 0].tolist() == [_ue8m0_scale(float(m)) for m in rows[:, 3]]
    peak = values.float().abs().amax(-1)[:, 0]
    assert ((peak >= 224) & (peak <= 448))[rows[:, 3] >= 1e-4].all()         # the top binade of e4m3 is used
    assert torch.equal(dequantize_index_keys(quantize_index_keys(rows), 32), torch.stack([_fp8_oracle(r) for r in rows]))


@pytest.mark.parametrize("head_dim", [32, 128, 200])
def test_fp8_key_rows_match_per_group_quantization(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    keys = torch.randn(6, head_dim, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0, 0.0])[:, None]
    keys[3, :5] = 1e4                                          # one outlier sets its group's scale
    rows = quantize_index_keys(keys)
    assert rows.dtype == torch.uint8 and rows.shape == (6, fp8_row_bytes(head_dim))
    assert fp8_row_bytes(128) == 132                           # DeepSeek-V3.2: 128 fp8 bytes + 1 scale
    decoded = dequantize_index_keys(rows, head_dim)
    expected = torch.stack([_fp8_oracle(row) for row in keys])
    assert torch.equal(decoded, expected)
    # e4m3 rounding: 2^-4 relative for normals, half the smallest subnormal step otherwise.
    scale = rows[:, head_dim:].contiguous().view(torch.float32).repeat_interleave(128, -1)[:, :head_dim]
    assert ((decoded - keys).abs() <= keys.abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()


def test_fp8_rows_need_float32_aligned_scales():
    with pytest.raises(ValueError, match="% 4"):
        fp8_row_bytes(30)


def build_fp8(block_size, seq_lens, query_lens, num_heads, head_dim, dtype):
    """:func:`build` with the keys stored as packed fp8 rows (the float keys are returned too)."""
    q, weights, _, block_tables, lens, qsl, keys = build(block_size, seq_lens, query_lens, num_heads, head_dim,
                                                         torch.float32)
    num_blocks = int(block_tables.max()) + 1
    k_cache = torch.zeros(num_blocks, block_size, fp8_row_bytes(head_dim), dtype=torch.uint8)
    for b, length in enumerate(seq_lens):
        store_cache_ref(quantize_index_keys(keys[b]), k_cache, slots_of(block_tables, b, torch.arange(length),
                                                                         block_size))
    return q.to(dtype), weights, k_cache, block_tables, lens, qsl, keys


def test_fp8_indexer_reference_scores_the_dequantized_keys():
    """Scores over the packed fp8 cache == the per-token loop over the oracle's dequantized keys."""
    seq_lens, query_lens = [18, 33], [3, 4]
    q, weights, k_cache, block_tables, lens, qsl, keys = build_fp8(16, seq_lens, query_lens, 3, 32, torch.float32)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 33)
    dequantized = [torch.stack([_fp8_oracle(row) for row in seq_keys]) for seq_keys in keys]
    torch.testing.assert_close(logits.double(), per_token_logits(q, weights, dequantized, seq_lens, query_lens, 33),
                               atol=1e-5, rtol=1e-5)


def test_fp8_query_reference_scores_the_dequantized_queries():
    """fp8 queries: scores == the per-token loop over dequantized queries and keys (both quantized
    per 128 dims with power-of-two scales, so the dequantized values are exact)."""
    seq_lens, query_lens = [18, 33], [3, 4]
    q, weights, k_cache, block_tables, lens, qsl, keys = build_fp8(16, seq_lens, query_lens, 3, 160, torch.float32)
    q_fp8, q_scale = quantize_index_queries(q)
    assert q_fp8.dtype == torch.float8_e4m3fn and q_scale.shape == (7, 3, 2)
    assert torch.equal(dequantize_index_queries(q_fp8, q_scale),
                       torch.stack([torch.stack([_fp8_oracle(head) for head in token]) for token in q]))
    logits = indexer_scores_ref(q_fp8, weights, k_cache, block_tables, lens, qsl, 33, q_scale=q_scale)
    dequantized_keys = [torch.stack([_fp8_oracle(row) for row in seq_keys]) for seq_keys in keys]
    oracle = per_token_logits(dequantize_index_queries(q_fp8, q_scale), weights, dequantized_keys, seq_lens,
                              query_lens, 33)
    torch.testing.assert_close(logits.double(), oracle, atol=1e-5, rtol=1e-5)


def test_fp8_queries_need_scales_and_the_fp8_cache():
    q, weights, k_cache, block_tables, lens, qsl, _ = build(16, [20], [4], 2, 32, torch.float32)
    q_fp8, q_scale = quantize_index_queries(q)
    with pytest.raises(ValueError, match="fp8 key cache only"):
        indexer_scores(q_fp8, weights, k_cache, block_tables, lens, qsl, 20, q_scale=q_scale)
    with pytest.raises(ValueError, match="come with their scales"):
        indexer_scores(q_fp8, weights, k_cache, block_tables, lens, qsl, 20)


# ---- attention sink: the first positions of each sequence always survive top-k

def _sink_oracle(logits: torch.Tensor, topk: int, sink: int) -> list[set[int]]:
    """Per row: the visible positions < ``sink``, then the best others until ``topk`` are chosen."""
    chosen = []
    for row in logits.tolist():
        visible = [s for s, value in enumerate(row) if value != float("-inf")]
        forced = [s for s in visible if s < sink][:topk]
        rest = sorted((s for s in visible if s >= sink), key=lambda s: -row[s])
        chosen.append(set(forced + rest[:topk - len(forced)]))
    return chosen


@pytest.mark.parametrize("sink", [0, 1, 3])
def test_select_topk_sink_replaces_the_lowest_ranked(sink):
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(sink))
    logits[:, :3] -= 10.0                                  # the sink candidates rank last
    logits[4:, :] = logits[4:].masked_fill(torch.arange(12) > torch.arange(9)[4:, None], float("-inf"))
    logits[3, 1:] = float("-inf")                          # a row that sees position 0 only
    picked = select_topk(logits, 5, sink)
    assert [set(row[row >= 0].tolist()) for row in picked] == _sink_oracle(logits, 5, sink)
    assert ((picked >= 0).sum(-1) == torch.isfinite(logits).sum(-1).clamp(max=5)).all(), "k stays k"


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("cache", ["model-dtype", "fp8-queries"])
def test_sink_holds_each_packed_sequences_own_first_keys(path, cache, monkeypatch):
    """3 packed sequences (chunked prefill, full prefill, one decode-like query) whose first two
    keys score lowest: with ``sink=2`` every row keeps positions 0 and 1 of its *own* sequence
    (not the batch's first cells) and otherwise the reference's best keys."""
    seq_lens, query_lens = [40, 23, 31], [6, 23, 1]
    make = build if cache == "model-dtype" else build_fp8
    q, weights, k_cache, block_tables, lens, qsl, keys = make(16, seq_lens, query_lens, 4, 32, torch.float32)
    q, weights = q.abs(), weights.abs()                    # every score is a sum of w * relu(q.k) >= 0
    for b, length in enumerate(seq_lens):                  # keys 0 and 1 point away from every query
        crafted = keys[b].abs()
        crafted[:2] = -crafted[:2] - 1.0
        rows = quantize_index_keys(crafted) if cache != "model-dtype" else crafted
        store_cache_ref(rows, k_cache, slots_of(block_tables, b, torch.arange(length), 16))
    q_scale = None
    if cache == "fp8-queries":
        q, q_scale = quantize_index_queries(q)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 40, q_scale=q_scale)
    monkeypatch.setenv("SHARDSERVE_KERNELS", path)
    plain = indexer_topk(q, weights, k_cache, block_tables, lens, 8, qsl, 40, q_scale=q_scale)
    sunk = indexer_topk(q, weights, k_cache, block_tables, lens, 8, qsl, 40, q_scale=q_scale, sink=2)
    long_rows = torch.isfinite(logits).sum(-1) >= 8 + 2        # rows where both crafted keys can lose
    assert long_rows.sum() >= 20
    assert not (plain[long_rows] < 2).any(), "the crafted first keys must lose without the sink"
    assert [set(row[row >= 0].tolist()) for row in sunk] == _sink_oracle(logits, 8, 2)
    assert ((sunk[long_rows] == 0).any(-1) & (sunk[long_rows] == 1).any(-1)).all()


# ---- bounded workspace: rows scored in chunks of at most `budget` logits

def test_row_chunks_cover_the_step_within_the_budget():
    """Prefill rows are cut so that rows x (last causal position + 1) <= budget (a single row
    wider than the budget runs alone); runs of one sequence are marked; decode rows are cut by
    count at the step's width."""
    gen = torch.Generator().manual_seed(3)
    for budget in (1, 50, 400, 10 ** 6):
        query_lens = torch.randint(1, 40, (5,), generator=gen).tolist()
        seq_lens = [q + int(torch.randint(0, 60, (1,), generator=gen)) for q in query_lens]
        qsl = query_start_loc_of(query_lens).tolist()
        chunks = plan_row_chunks(qsl[-1], max(seq_lens), qsl, seq_lens, budget)
        positions = [length - q + i for q, length in zip(query_lens, seq_lens) for i in range(q)]
        seq_of_row = [b for b, q in enumerate(query_lens) for _ in range(q)]
        assert [c.start for c in chunks] == [0] + [c.end for c in chunks[:-1]] and chunks[-1].end == qsl[-1]
        for c in chunks:
            rows = range(c.start, c.end)
            assert c.width == max(positions[r] for r in rows) + 1
            assert len(rows) * c.width <= budget or len(rows) == 1
            assert [r for first, end, _, _ in c.segments for r in range(first, end)] == list(rows)
            assert all(seq_of_row[r] == seq for first, end, seq, _ in c.segments for r in range(first, end))
            assert all(keys == positions[end - 1] + 1 for first, end, _, keys in c.segments)
    decode = plan_row_chunks(10, 300, budget=1000)
    assert [(c.start, c.end, c.width, c.segments) for c in decode] == [(0, 3, 300, None), (3, 6, 300, None),
                                                                      (6, 9, 300, None), (9, 10, 300, None)]


def _picked_scores(logits: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """The logits of each row's selected keys, sorted (ties at 0 may pick different keys)."""
    values = logits.gather(1, picked.long().clamp(min=0)).masked_fill(picked < 0, float("-inf"))
    return values.sort(-1).values


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("cache", ["model-dtype", "fp8-queries"])
def test_chunked_topk_equals_one_shot_selection(path, cache, monkeypatch):
    """Chunks of a few rows (budget 100 logits) select what scoring every row at once selects
    (prefill with a cached prefix, a fresh prompt, a decode-like row; and a decode step)."""
    seq_lens, query_lens = [70, 23, 31], [9, 23, 1]
    make = build if cache == "model-dtype" else build_fp8
    q, weights, k_cache, block_tables, lens, qsl, _ = make(16, seq_lens, query_lens, 3, 32, torch.float32)
    q_scale = None
    if cache == "fp8-queries":
        q, q_scale = quantize_index_queries(q)
    logits = indexer_scores_ref(q, weights, k_cache, block_tables, lens, qsl, 70, q_scale=q_scale)
    monkeypatch.setenv("SHARDSERVE_KERNELS", path)
    whole = indexer_topk(q, weights, k_cache, block_tables, lens, 8, qsl, 70, q_scale=q_scale, sink=1,
                         budget=1 << 30)
    chunked = indexer_topk(q, weights, k_cache, block_tables, lens, 8, qsl, 70, q_scale=q_scale, sink=1,
                           budget=100, query_start_host=qsl.tolist(), seq_lens_host=seq_lens)
    assert torch.equal(whole[:, 0], chunked[:, 0])                             # the sink column
    torch.testing.assert_close(_picked_scores(logits, chunked), _picked_scores(logits, whole), atol=1e-5, rtol=0)
    last = qsl[1:] - 1                                       # decode: each sequence's last token
    scales = None if q_scale is None else q_scale[last]
    decode = indexer_topk(q[last], weights[last], k_cache, block_tables, lens, 8, None, 70, q_scale=scales,
                          sink=1, budget=70)                 # one row per chunk
    torch.testing.assert_close(_picked_scores(logits[last], decode), _picked_scores(logits[last], whole[last]),
                               atol=1e-5, rtol=0)
