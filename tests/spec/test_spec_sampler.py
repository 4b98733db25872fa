"""Speculative rejection sampling preserves the target distribution (Leviathan et al. 2023).

A tiny vocabulary Markov chain stands in for the models: the target's next-token logits depend on
the previous token (table ``P``), the draft's on the previous token too (a different table ``Q``),
so chained drafts, partial acceptance, residual draws and bonus tokens all occur. Speculative
decoding with the real ``draft_sample`` and ``verify_step`` (the draft's ``q`` in a shared buffer
row, every request of a step verified in one batch, requests at different depths side by side)
must produce 3-token continuations distributed exactly as the chain under ``P`` (chi-square
goodness of fit, and a two-sample test against plain ``sample``); seeded runs are reproducible.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardserve.workers.messages import SamplingOptions, ScheduledRequest
from shardserve.workers.rejection_sampler import accept_drafts, draft_sample, sample_with_drafts, verify_step
from shardserve.workers.sampler import sample, sampling_probs
from spec_helpers import chi_square_p, two_sample_p

VOCAB = 5
NUM_OUT = 3          # continuation length whose joint law is tested (125 cells)
NUM_SAMPLES = 6000
P_VALUE = 0.01


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    target = 1.5 * torch.randn(VOCAB, VOCAB, generator=gen)
    draft = 1.5 * torch.randn(VOCAB, VOCAB, generator=gen)   # a poor draft: many rejections
    return target, draft


def speculative_batch(target, draft, options: list[SamplingOptions], depths: list[int], first: int,
                      gen: torch.Generator | None = None) -> tuple[list[list[int]], int]:
    """``NUM_OUT`` tokens after ``first`` for every request (request ``i`` drafts ``depths[i]`` per
    step), all requests of a step verified together; returns (tokens, verify steps of all requests)."""
    num = len(options)
    max_depth = max(depths)
    q_buffer = torch.zeros(num, max_depth, VOCAB)
    tokens = [[first] for _ in range(num)]
    forwards = 0
    while True:
        live = [i for i in range(num) if len(tokens[i]) - 1 < NUM_OUT]
        if not live:
            break
        drafts = {i: [] for i in live}
        prev = torch.tensor([tokens[i][-1] for i in live])
        for j in range(max_depth):
            rows = [pos for pos, i in enumerate(live) if depths[i] > j]
            if not rows:
                break
            out, q = draft_sample(draft[prev[rows]], [options[live[r]] for r in rows],
                                  [len(tokens[live[r]]) - 1 + j for r in rows], gen)
            for r, token in zip(rows, out.tolist()):
                drafts[live[r]].append(token)
            if q is not None:
                q_buffer[[live[r] for r in rows], j] = q
            prev[rows] = out
        sched = [ScheduledRequest(str(i), [tokens[i][-1]] + drafts[i], 0, [], True, len(tokens[i]) - 1,
                                  num_spec_tokens=len(drafts[i]), draft_probs_row=i) for i in live]
        logits = torch.cat([target[torch.tensor([tokens[i][-1]] + drafts[i])] for i in live])
        forwards += len(live)
        for i, emitted in zip(live, verify_step(logits, sched, [options[i] for i in live], q_buffer, gen)):
            assert 1 <= len(emitted) <= depths[i] + 1
            tokens[i] += [t.token_id for t in emitted]
    return [t[1:NUM_OUT + 1] for t in tokens], forwards


def exact_law(target, option: SamplingOptions, first: int) -> torch.Tensor:
    """``[VOCAB ** NUM_OUT]`` probabilities of each continuation under the filtered target chain."""
    probs = sampling_probs(target, [option] * VOCAB).double()       # [prev, next]
    law = torch.empty(VOCAB ** NUM_OUT, dtype=torch.float64)
    for cell, seq in enumerate(itertools.product(range(VOCAB), repeat=NUM_OUT)):
        prev, mass = first, 1.0
        for token in seq:
            mass, prev = mass * probs[prev, token].item(), token
        law[cell] = mass
    return law


def _counts(seqs: list[list[int]]) -> torch.Tensor:
    counts = torch.zeros(VOCAB ** NUM_OUT, dtype=torch.float64)
    for seq in seqs:
        counts[sum(token * VOCAB ** (NUM_OUT - 1 - i) for i, token in enumerate(seq))] += 1
    return counts


@pytest.mark.parametrize("option", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.95)],
                         ids=["t1", "t0.7-topk4-topp0.95"])
def test_rejection_sampling_preserves_target_distribution(option):
    """Depths 1, 2 and 3 side by side in every verify batch."""
    target, draft = _tables()
    first, gen = 0, torch.Generator().manual_seed(11)
    options = [SamplingOptions(**option)] * NUM_SAMPLES
    seqs, steps = speculative_batch(target, draft, options, [1 + i % 3 for i in range(NUM_SAMPLES)], first, gen)
    spec_counts = _counts(seqs)
    plain = [[first] for _ in range(NUM_SAMPLES)]
    for index in range(NUM_OUT):
        tokens, _ = sample(target[torch.tensor([p[-1] for p in plain])], options, [index] * NUM_SAMPLES, gen)
        for p, token in zip(plain, tokens):
            p.append(token)
    plain_counts = _counts([p[1:] for p in plain])
    expected = exact_law(target, SamplingOptions(**option), first) * NUM_SAMPLES
    p_fit, p_plain, p_two = (chi_square_p(spec_counts, expected), chi_square_p(plain_counts, expected),
                             two_sample_p(spec_counts, plain_counts))
    print(f"{option}: goodness of fit p={p_fit:.3f} (plain sampling p={p_plain:.3f}), spec vs plain p={p_two:.3f}, "
          f"{NUM_SAMPLES * NUM_OUT / steps:.2f} tokens per verify step")
    assert p_fit > P_VALUE and p_two > P_VALUE and p_plain > P_VALUE
    assert steps < NUM_SAMPLES * NUM_OUT, "some drafts must be accepted"


def test_seeded_speculative_sampling_is_reproducible_whatever_the_batch():
    """A seeded request's tokens depend on its seed and depth only, not on its batch neighbours."""
    target, draft = _tables()
    seeded = SamplingOptions(temperature=1.0, seed=1234)
    alone = speculative_batch(target, draft, [seeded], [3], 2)[0][0]
    for neighbours in (1, 5):
        options = [SamplingOptions(temperature=1.0, seed=s) for s in range(neighbours)] + [seeded]
        assert speculative_batch(target, draft, options, [2] * neighbours + [3], 2)[0][-1] == alone


def test_perfect_draft_is_always_accepted():
    """q == p: every draft passes the test (u * q < p holds for u < 1); k + 1 tokens per step."""
    target, _ = _tables()
    options = [SamplingOptions(temperature=1.0, seed=seed) for seed in range(50)]
    seqs, steps = speculative_batch(target, target, options, [NUM_OUT - 1] * 50, 1)
    assert steps == 50 and all(len(seq) == NUM_OUT for seq in seqs)


def test_greedy_verification_keeps_longest_matching_prefix():
    """Three requests in one batch: all kept + bonus, corrected at draft 2, first draft rejected."""
    best = torch.tensor([[3, 1, 4, 2]] * 3)
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4], [0, 1, 4]])
    tokens, emitted = accept_drafts(best, None, drafts, torch.tensor([3, 3, 3]), None, torch.ones(3, dtype=torch.bool),
                                    torch.rand(3, 3), torch.ones(3, VOCAB))
    assert [row[:n] for row, n in zip(tokens.tolist(), emitted.tolist())] == [[3, 1, 4, 2], [3, 1], [3]]
    # fewer drafts than the batch's widest: the bonus comes from the row after the last draft
    tokens, emitted = accept_drafts(best, None, drafts, torch.tensor([1, 2, 0]), None, torch.ones(3, dtype=torch.bool),
                                    torch.rand(3, 3), torch.ones(3, VOCAB))
    assert [row[:n] for row, n in zip(tokens.tolist(), emitted.tolist())] == [[3, 1], [3, 1], [3]]


def test_verification_uses_processed_logits_and_logprobs_the_raw_ones():
    """A plain request and a greedy one verifying 2 drafts in one step: tokens follow the processed
    (masked / penalized) logits, the reported logprobs are the raw logits' log-softmax."""
    raw = torch.tensor([[0.0, 5.0, 1.0, 2.0, 3.0]] * 4)
    processed = raw.clone()
    processed[:, 1] = float("-inf")                    # the grammar forbids token 1 everywhere
    sampling = [ScheduledRequest("plain", [2], 3, [], True, 0),
                ScheduledRequest("spec", [2, 4, 4], 3, [], True, 0, num_spec_tokens=2)]
    options = [SamplingOptions(temperature=0.0, logprobs=1)] * 2
    out = sample_with_drafts(processed, sampling, options, None, logprob_logits=raw)
    raw_logprobs = raw[0].log_softmax(-1)
    assert [(t.req_id, t.token_id) for t in out] == [("plain", 4), ("spec", 4), ("spec", 4), ("spec", 4)]
    for token in out:
        assert token.logprob == pytest.approx(raw_logprobs[4].item())
        assert token.top_logprobs[0][0] == 1 and token.top_logprobs[0][1] == pytest.approx(raw_logprobs[1].item())
