"""Speculative rejection sampling preserves the target distribution (Leviathan et al. 2023).

A tiny vocabulary Markov chain stands in for the models: the target's next-token logits depend on
the previous token (table ``P``), the draft's on the previous token too (a different table ``Q``),
so chained drafts, partial acceptance, residual draws and bonus tokens all occur. Speculative
decoding with the real ``draft_sample`` / ``verify_drafts`` must produce 3-token continuations
distributed exactly as the chain under ``P`` (chi-square goodness of fit, and a two-sample test
against plain ``sample``), for every seed reproducibly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardserve.workers.messages import SamplingOptions
from shardserve.workers.sampler import draft_sample, sample, sampling_probs, verify_drafts

VOCAB = 5
NUM_OUT = 3          # continuation length whose joint law is tested (125 cells)
NUM_SAMPLES = 6000
P_VALUE = 0.01


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    target = 1.5 * torch.randn(VOCAB, VOCAB, generator=gen)
    draft = 1.5 * torch.randn(VOCAB, VOCAB, generator=gen)   # a poor draft: many rejections
    return target, draft


def speculative_continuation(target, draft, option: SamplingOptions, num_drafts: int, first: int) -> tuple[list, int]:
    """``NUM_OUT`` tokens after ``first`` by draft/verify steps; returns (tokens, target forwards)."""
    tokens, forwards = [first], 0
    while len(tokens) - 1 < NUM_OUT:
        index = len(tokens) - 1                     # output index of the next token
        drafts, qs, prev = [], [], tokens[-1]
        for j in range(num_drafts):
            (token,), (q,) = draft_sample(draft[prev][None], [option], [index + j])
            drafts.append(token)
            qs.append(q)
            prev = token
        rows = target[torch.tensor([tokens[-1]] + drafts)]   # row j scores the token after draft j
        emitted = verify_drafts(rows, option, drafts, torch.stack(qs) if qs[0] is not None else None, index)
        assert 1 <= len(emitted) <= num_drafts + 1
        tokens += emitted
        forwards += 1
    return tokens[1:NUM_OUT + 1], forwards


def plain_continuation(target, option: SamplingOptions, first: int) -> list[int]:
    tokens = [first]
    for index in range(NUM_OUT):
        (token,), _ = sample(target[tokens[-1]][None], [option], [index])
        tokens.append(token)
    return tokens[1:]


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


def _cell(seq: list[int]) -> int:
    return sum(token * VOCAB ** (NUM_OUT - 1 - i) for i, token in enumerate(seq))


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson goodness of fit; cells expecting < 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat((observed[~small], observed[small].sum()[None]))
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def two_sample_p(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Chi-square test of homogeneity of two count vectors (cells with < 10 in total pooled)."""
    total = counts_a + counts_b
    small = total < 10
    a = torch.cat((counts_a[~small], counts_a[small].sum()[None]))
    b = torch.cat((counts_b[~small], counts_b[small].sum()[None]))
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    n_a, n_b = a.sum(), b.sum()
    exp_a, exp_b = (a + b) * n_a / (n_a + n_b), (a + b) * n_b / (n_a + n_b)
    stat = ((a - exp_a) ** 2 / exp_a + (b - exp_b) ** 2 / exp_b).sum()
    return torch.special.gammaincc(torch.tensor((a.numel() - 1) / 2, dtype=torch.float64), stat / 2).item()


@pytest.mark.parametrize("num_drafts,option", [
    (2, dict(temperature=1.0)),
    (3, dict(temperature=0.7, top_k=4, top_p=0.95)),
], ids=["k2-t1", "k3-t0.7-topk4-topp0.95"])
def test_rejection_sampling_preserves_target_distribution(num_drafts, option):
    target, draft = _tables()
    first = 0
    spec_counts = torch.zeros(VOCAB ** NUM_OUT, dtype=torch.float64)
    plain_counts = torch.zeros_like(spec_counts)
    forwards = 0
    for seed in range(NUM_SAMPLES):
        opt = SamplingOptions(seed=seed, **option)
        seq, used = speculative_continuation(target, draft, opt, num_drafts, first)
        spec_counts[_cell(seq)] += 1
        plain_counts[_cell(plain_continuation(target, SamplingOptions(seed=10**6 + seed, **option), first))] += 1
        forwards += used
    expected = exact_law(target, SamplingOptions(**option), first) * NUM_SAMPLES
    p_fit = chi_square_p(spec_counts, expected)
    p_plain = chi_square_p(plain_counts, expected)
    p_two = two_sample_p(spec_counts, plain_counts)
    print(f"k={num_drafts} {option}: goodness of fit p={p_fit:.3f} (plain sampling p={p_plain:.3f}), "
          f"spec vs plain p={p_two:.3f}, {NUM_SAMPLES * NUM_OUT / forwards:.2f} tokens per target forward")
    assert p_fit > P_VALUE and p_two > P_VALUE and p_plain > P_VALUE
    assert forwards < NUM_SAMPLES * NUM_OUT, "some drafts must be accepted"


def test_seeded_speculative_sampling_is_reproducible():
    target, draft = _tables()
    opt = SamplingOptions(temperature=1.0, seed=1234)
    runs = [speculative_continuation(target, draft, opt, 3, 2)[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_perfect_draft_is_always_accepted():
    """q == p: every draft passes the test (u * q < p holds for u < 1); k + 1 tokens per forward."""
    target, _ = _tables()
    for seed in range(50):
        opt = SamplingOptions(temperature=1.0, seed=seed)
        seq, forwards = speculative_continuation(target, target, opt, NUM_OUT - 1, 1)
        assert forwards == 1 and len(seq) == NUM_OUT


def test_greedy_verification_keeps_longest_matching_prefix():
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    greedy = SamplingOptions(temperature=0)
    assert verify_drafts(logits, greedy, [3, 1, 4], None, 0) == [3, 1, 4, 2]   # all kept + bonus
    assert verify_drafts(logits, greedy, [3, 0, 4], None, 0) == [3, 1]         # corrected at draft 2
    assert verify_drafts(logits, greedy, [0, 1, 4], None, 0) == [3]            # first draft rejected
