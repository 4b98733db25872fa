"""Sampler: filters vs a naive per-row reference, greedy, seeded streams, and the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from shardserve.workers.messages import SamplingOptions
from shardserve.workers.sampler import filter_logits, sample, sample_on_device, sampled_tokens
from shardserve.workers.sync_guard import no_host_sync


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


def test_a_mixed_batch_samples_on_the_device_and_reads_back_once(monkeypatch):
    """Greedy, seeded, unseeded, top-k / top-p / min-p and logprob rows in one batch: no host read
    while sampling (the guard of workers/sync_guard.py; host-to-device copies allowed), one
    device-to-host transfer for tokens and logprobs, and every row's token equals the row sampled
    alone (seeded streams; the one unseeded row draws from an equally seeded generator)."""
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)) * 2
    options = [SamplingOptions(temperature=0, logprobs=3), SamplingOptions(temperature=0.7, top_k=5, seed=9),
               SamplingOptions(temperature=1.1, top_p=0.8), SamplingOptions(temperature=0.9, min_p=0.1, seed=4, logprobs=0),
               SamplingOptions(temperature=0, top_k=3)]
    indices = [0, 4, 2, 7, 1]
    with torch.inference_mode(), no_host_sync("the sampler", uploads=True):
        tokens, logprobs = sample_on_device(logits, options, indices, torch.Generator().manual_seed(31))
    alone = [sample(logits[i:i + 1], [o], [indices[i]], torch.Generator().manual_seed(31))[0][0]
             for i, o in enumerate(options)]
    transfers = []
    original_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: transfers.append(self.shape) or original_cpu(self, *a, **k))
    out = sampled_tokens([f"r{i}" for i in range(5)], tokens, logprobs, options)
    assert [t.token_id for t in out] == alone and alone[0] == int(logits[0].argmax()) and alone[4] == int(logits[4].argmax())
    assert len(transfers) == 1, transfers
    assert [len(t.top_logprobs or []) for t in out] == [3, 0, 0, 0, 0] and out[2].logprob is None
    top = logits[0].log_softmax(-1).topk(3)
    assert [i for i, _ in out[0].top_logprobs] == top.indices.tolist()
    assert out[3].logprob == pytest.approx(logits[3].log_softmax(-1)[alone[3]].item())
    # Masked / penalized logits (a grammar forbids row 0's and row 4's argmax) are drawn from; the
    # logprobs stay those of the raw logits, still without a host read.
    processed = logits.clone()
    processed[[0, 4], [alone[0], alone[4]]] = float("-inf")
    with torch.inference_mode(), no_host_sync("the sampler on processed logits", uploads=True):
        tokens, logprobs = sample_on_device(processed, options, indices, torch.Generator().manual_seed(31),
                                            logprob_logits=logits)
    assert tokens[0] == processed[0].argmax() != alone[0] and tokens[4] == processed[4].argmax() != alone[4]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1))
