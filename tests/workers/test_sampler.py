"""Sampler: filters vs a naive per-row reference, greedy, seeded streams, and the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from shardserve.workers.messages import SamplingOptions
from shardserve.workers.sampler import filter_logits, sample


def naive_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the obvious way: sort, keep the first k, then the smallest prefix reaching top_p,
    then drop tokens under min_p * max prob (transformers' warper order)."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(row[keep], 0).tolist()
    kept, mass = [], 0.0
    for idx, p in zip(keep, probs):
        if kept and mass >= top_p:
            break
        kept.append(idx)
        mass += p
    probs = torch.softmax(row[kept], 0)
    kept = [i for i, p in zip(kept, probs.tolist()) if p >= min_p * probs.max().item()]
    out = torch.full_like(row, float("-inf"))
    out[kept] = row[kept]
    return out


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2),
                                               (5, 0.5, 0.1), (1, 1.0, 0.0), (0, 0.01, 0.0)])
def test_filter_matches_naive(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=gen) * 3
    n = logits.shape[0]
    got = filter_logits(logits, torch.full((n,), top_k), torch.full((n,), top_p), torch.full((n,), min_p))
    for row in range(n):
        assert torch.equal(got[row], naive_filter(logits[row], top_k, top_p, min_p))


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    tokens, lp = sample(logits, [SamplingOptions(temperature=0, logprobs=2)] * 3, [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, logits.log_softmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    seeded = SamplingOptions(temperature=1.0, seed=7)
    alone, _ = sample(logits[2:3], [seeded], [5])
    mixed, _ = sample(logits, [SamplingOptions(), SamplingOptions(temperature=0), seeded, SamplingOptions()],
                      [0, 0, 5, 3], torch.Generator().manual_seed(123))
    assert mixed[2] == alone[0]
    streams = [sample(logits[2:3], [seeded], [i])[0][0] for i in range(20)]
    assert len(set(streams)) > 1  # the output index moves the stream


def test_sampling_follows_the_distribution():
    """Chi-square over 20000 seeded draws from a 5-token vocabulary (critical value, df=4, p=0.01: 13.28)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / 0.8, 0)
    counts = torch.zeros(5)
    for i in range(20000):
        (token,), _ = sample(logits, [SamplingOptions(temperature=0.8, seed=11)], [i])
        counts[token] += 1
    expected = probs * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.28, (counts, expected)


def test_top_k_and_min_p_never_leave_the_kept_set():
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0, -3.0]])
    seen = set()
    for i in range(300):
        (token,), _ = sample(logits, [SamplingOptions(temperature=1.0, top_k=2, seed=3)], [i])
        seen.add(token)
    assert seen == {0, 1}
    seen = {sample(logits, [SamplingOptions(temperature=1.0, min_p=0.05, seed=4)], [i])[0][0] for i in range(300)}
    assert seen == {0, 1} and not math.isnan(logits.sum())
