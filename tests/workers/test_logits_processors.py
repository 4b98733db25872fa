"""Rank 0's logits processing (``workers/logits_processors.py``) against a straight, per-token torch
reference of the definitions: OpenAI's presence / frequency penalties and logit_bias, the CTRL /
vLLM repetition penalty, vLLM's min_tokens, bad_words and allowed_token_ids; speculative
verification rows count the drafts before them; the grammar bitmask sets exactly the forbidden
logits to -inf. No model: the logits are a recorded-once random tensor."""

from __future__ import annotations

import pytest
import torch

from shardserve.workers.logits_processors import SamplingControls, apply_token_bitmasks
from shardserve.workers.messages import SampledToken, SamplingOptions, ScheduledRequest

VOCAB = 50
INF = float("inf")


def reference(logits: torch.Tensor, opt: SamplingOptions, prompt: list[int], output: list[int],
              output_index: int) -> torch.Tensor:
    """One row, token by token, as the definitions read (vLLM's order: allowed, bad words,
    min_tokens, logit_bias, repetition, frequency, presence)."""
    row = logits.clone()
    for t in range(VOCAB):
        if opt.allowed_token_ids is not None and t not in opt.allowed_token_ids:
            row[t] = -INF
    for word in opt.bad_words_ids or []:
        if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
            row[word[-1]] = -INF
    if output_index < opt.min_tokens:
        for t in opt.min_stop_ids:
            row[t] = -INF
    for t, bias in (opt.logit_bias or {}).items():
        row[t] += bias
    for t in range(VOCAB):
        count = output.count(t)
        if t in prompt or count:
            row[t] = row[t] / opt.repetition_penalty if row[t] > 0 else row[t] * opt.repetition_penalty
        row[t] -= opt.frequency_penalty * count + opt.presence_penalty * (count > 0)
    return row


OPTIONS = [
    SamplingOptions(presence_penalty=0.7, frequency_penalty=0.3),
    SamplingOptions(repetition_penalty=1.4),
    SamplingOptions(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=-1.0),
    SamplingOptions(logit_bias={3: 100.0, 7: -100.0, 11: 2.5}),
    SamplingOptions(min_tokens=3, min_stop_ids=[0, 5]),
    SamplingOptions(bad_words_ids=[[4], [6, 8], [1, 2, 9]]),
    SamplingOptions(allowed_token_ids=[1, 2, 3, 40], logit_bias={2: -1.0}),
    SamplingOptions(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0, logit_bias={6: 5.0},
                    min_tokens=5, min_stop_ids=[6], bad_words_ids=[[9, 9]]),
]


@pytest.fixture()
def recorded():
    return torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def history(seed: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    output = torch.randint(0, 12, (6,), generator=gen).tolist() + [6, 1, 2]   # repeats, bad-word prefixes
    return prompt, output


@pytest.mark.parametrize("option", OPTIONS, ids=range(len(OPTIONS)))
@pytest.mark.parametrize("num_output", [0, 2, 9])
def test_plain_rows_match_the_reference(recorded, option, num_output):
    controls = SamplingControls(VOCAB, "cpu", capacity=1)
    rows, expected = [], []
    for i in range(3):   # three requests with the same controls, different histories; grows the pool
        prompt, output = history(i)
        output = output[:num_output]
        controls.add(f"r{i}", option, prompt + output, len(prompt))
        rows.append(ScheduledRequest(f"r{i}", [output[-1] if output else prompt[-1]], 0, [], True, len(output)))
        expected.append(reference(recorded[i], option, prompt, output, len(output)))
    logits = recorded[:3].clone()
    controls.apply(logits, rows)
    torch.testing.assert_close(logits, torch.stack(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("option", OPTIONS, ids=range(len(OPTIONS)))
def test_verification_rows_count_the_drafts_before_them(recorded, option):
    """Row j of a request verifying k drafts is processed as plain decoding would after emitting
    drafts[:j]: the target distribution of speculative decoding is the plain one, penalties included."""
    prompt, output = history(3)
    drafts = [6, 8, 9, 9]
    controls = SamplingControls(VOCAB, "cpu")
    controls.add("a", SamplingOptions(), prompt, len(prompt))   # a request without controls: untouched
    controls.remove("a")
    controls.add("r", option, prompt + output, len(prompt))
    plain = ScheduledRequest("p", [1], 0, [], True, 0)
    spec = ScheduledRequest("r", [output[-1]] + drafts, 20, [], True, len(output), num_spec_tokens=len(drafts))
    logits = recorded[:1 + len(drafts) + 1].clone()
    controls.apply(logits, [plain, spec])
    torch.testing.assert_close(logits[0], recorded[0])
    for j in range(len(drafts) + 1):
        want = reference(recorded[1 + j], option, prompt, output + drafts[:j], len(output) + j)
        torch.testing.assert_close(logits[1 + j], want, rtol=0, atol=1e-5)


def test_record_counts_emitted_tokens_and_a_preempted_request_restarts_from_its_history(recorded):
    option = SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
                             bad_words_ids=[[3, 4]])
    prompt, output = history(4)
    live = SamplingControls(VOCAB, "cpu")
    live.add("r", option, prompt, len(prompt))
    for token in output:   # one token per step, as sampled (a verify step emits several, in order)
        live.record([SampledToken("r", token), SampledToken("other", 1)])
    again = SamplingControls(VOCAB, "cpu")
    again.add("r", option, prompt + output, len(prompt))   # after a preemption: the history in full
    step = [ScheduledRequest("r", [output[-1]], 0, [], True, len(output))]
    a, b = recorded[:1].clone(), recorded[:1].clone()
    live.apply(a, step)
    again.apply(b, step)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0], reference(recorded[0], option, prompt, output, len(output)), rtol=0, atol=1e-5)
    live.remove("r")
    live.remove("r")   # idempotent
    assert not live.requests and len(live._free) == live.counts.shape[0]


def test_min_tokens_never_empties_a_row(recorded):
    """A grammar that allows only EOS where min_tokens forbids it: the grammar's mask wins."""
    controls = SamplingControls(VOCAB, "cpu")
    controls.add("r", SamplingOptions(min_tokens=4, min_stop_ids=[0]), [5], 1)
    logits = torch.full((1, VOCAB), -INF)
    logits[0, 0] = 1.0
    controls.apply(logits, [ScheduledRequest("r", [5], 0, [], True, 1)])
    assert logits[0, 0] == 1.0


def test_token_bitmask_sets_exactly_the_forbidden_logits(recorded):
    vocab = 70   # not a multiple of 32: the last word is partial
    allowed = [{0, 31, 32, 69}, {5}, set(range(70))]
    masks = torch.zeros(3, 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            masks[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampling = [ScheduledRequest("free", [1], 0, [], True, 0),
                ScheduledRequest("spec", [1, 2, 3], 0, [], True, 0, num_spec_tokens=2, token_bitmask=masks),
                ScheduledRequest("free2", [1], 0, [], True, 0)]
    apply_token_bitmasks(logits, sampling)
    torch.testing.assert_close(logits[[0, 4]], before[[0, 4]])
    for row, tokens in enumerate(allowed):
        keep = torch.tensor([t in tokens for t in range(vocab)])
        assert torch.equal(logits[1 + row][keep], before[1 + row][keep])
        assert torch.isinf(logits[1 + row][~keep]).all()
