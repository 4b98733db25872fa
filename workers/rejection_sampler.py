"""Speculative decoding's sampling: the draft model's proposals and rank 0's verification.

Verification is standard speculative rejection sampling (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): draft ``d_j ~ q_j`` is
kept with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one is replaced by a draw
from ``norm(max(0, p_j - q_j))``; when all are kept a bonus token is drawn from ``p_{k+1}``. The
emitted tokens are distributed exactly as plain sampling from ``p`` (the filtered target
distribution of ``workers/sampler.py``). Greedy requests keep the longest prefix of drafts equal to
the target's argmax, then the argmax after it: the same tokens as plain greedy decoding.

Everything is batched over requests and draft positions (:func:`accept_drafts` is pure tensor
math, gpt-fast's and vLLM's ``rejection_sampler`` shape of it): no per-token Python and no host
read of a device scalar; a step reads its result back once (``[N, k + 1]`` tokens and ``[N]``
counts in one transfer). A hook that changes the target distribution (a grammar mask, penalties)
applies it to the logits before :func:`verify_step`; :func:`accept_drafts` only sees ``p``.

Randomness: a seeded request's accept tests and its final draw come from one generator keyed by
``(seed, output index of the step's first token)``; its draft tokens from generators keyed by
``(seed, output index, DRAFT_STREAM)``. Unseeded requests share the engine's (or the draft
worker's) generator. A seed reproduces a request's tokens when its steps verify the same numbers
of drafts (always with ``--speculative-policy fixed``; the adaptive policy picks depths from
measured times, so there a seeded request is an exact sample but may differ between runs).
"""

from __future__ import annotations

import torch

from shardserve.workers.messages import SampledToken, SamplingOptions, ScheduledRequest
from shardserve.workers.sampler import (DRAFT_STREAM, is_greedy, sample, sampled_tokens, sampling_probs,
                                        seeded_generator)


def exponential_noise(options: list[SamplingOptions], output_indices: list[int], vocab: int, device: torch.device,
                      generator: torch.Generator | None, stream: int = 0) -> torch.Tensor:
    """``[N, vocab]`` float32 ``Exp(1)`` noise for the exponential race: unseeded rows in one draw from
    ``generator``, each seeded row from its ``(seed, output index, stream)`` generator."""
    noise = torch.empty(len(options), vocab, device=device).exponential_(generator=generator)
    for row, (option, index) in enumerate(zip(options, output_indices)):
        if option.seed is not None:
            noise[row].exponential_(generator=seeded_generator(option.seed, index, stream, device))
    return noise


def draft_sample(logits: torch.Tensor, options: list[SamplingOptions], output_indices: list[int],
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft model's proposals, on the logits' device: argmax for greedy rows, else a draw from
    ``q`` = the row's filtered distribution (kept for verification).

    Args:
        logits: ``[N, V]`` float32 draft logits.
        options: per-row sampling settings. output_indices: per row, the output index the draft is for.
        generator: noise for unseeded rows.

    Returns:
        ``(token ids [N] int64, q [N, V] float32 with zero rows for greedy requests, or None when
        every row is greedy)``.
    """
    tokens = logits.argmax(dim=-1)
    random_rows = [row for row, option in enumerate(options) if not is_greedy(option)]
    if not random_rows:
        return tokens, None
    idx = torch.tensor(random_rows, device=logits.device)
    opts = [options[row] for row in random_rows]
    q = sampling_probs(logits[idx], opts)
    noise = exponential_noise(opts, [output_indices[row] for row in random_rows], logits.shape[1], logits.device,
                              generator, DRAFT_STREAM)
    tokens[idx] = (q / noise).argmax(dim=-1)
    probs = torch.zeros_like(logits)
    probs[idx] = q
    return tokens, probs


def accept_drafts(target_argmax: torch.Tensor, target_probs: torch.Tensor | None, draft_token_ids: torch.Tensor,
                  num_drafts: torch.Tensor, draft_probs: torch.Tensor | None, greedy: torch.Tensor,
                  uniform: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of every request's drafts and add the bonus or corrected token.

    ``N`` requests, at most ``K`` drafts each, vocabulary ``V``; all tensors on one device.

    Args:
        target_argmax: ``[N, K + 1]`` int64, argmax of the target's logits; row ``j`` scores the token
            after draft ``j`` (row 0: after the last accepted token).
        target_probs: ``[N, K + 1, V]`` float32 filtered target distributions ``p`` (rows of greedy
            requests are ignored); None when every request is greedy.
        draft_token_ids: ``[N, K]`` int64 drafts (entries past ``num_drafts`` are ignored).
        num_drafts: ``[N]`` int64 drafts of each request, in ``0..K``.
        draft_probs: ``[N, K, V]`` float32 draft distributions ``q`` (greedy rows ignored); None when
            every request is greedy.
        greedy: ``[N]`` bool, the request decodes greedily.
        uniform: ``[N, K]`` float32 ``U(0, 1)`` for the accept tests.
        noise: ``[N, V]`` float32 ``Exp(1)`` for the final draw (exponential race).

    Returns:
        ``(tokens [N, K + 1] int64, num_emitted [N] int64)``: request ``i`` emits
        ``tokens[i, :num_emitted[i]]``, its accepted drafts then the bonus or corrected token.
    """
    num_requests, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    rows = torch.arange(num_requests, device=device)
    accept = draft_token_ids == target_argmax[:, :max_drafts]                         # [N, K] greedy rule
    if target_probs is not None:
        drafted = draft_token_ids[..., None]
        p_draft = target_probs[:, :max_drafts].gather(-1, drafted)[..., 0]            # [N, K] p_j(d_j)
        q_draft = draft_probs.gather(-1, drafted)[..., 0]                              # [N, K] q_j(d_j)
        accept = torch.where(greedy[:, None], accept, uniform * q_draft < p_draft)     # u < p/q, no division
    accept &= torch.arange(max_drafts, device=device)[None, :] < num_drafts[:, None]
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)                           # [N] leading accepts
    final = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    if target_probs is not None:
        p_final = target_probs[rows, num_accepted]                                     # [N, V]
        rejected = num_accepted < num_drafts                                           # a draft was rejected
        q_final = draft_probs[rows, num_accepted.clamp(max=max(max_drafts - 1, 0))] * rejected[:, None]
        residual = (p_final - q_final).clamp_(min=0.0)
        # p == q where it matters leaves no residual mass (float noise): draw from p, as plain sampling
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_final)
        final = torch.where(greedy, final, (residual / noise).argmax(dim=-1))
    tokens = torch.cat((draft_token_ids, torch.zeros_like(draft_token_ids[:, :1])), dim=1)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return tokens, num_accepted + 1


def verification_noise(options: list[SamplingOptions], output_indices: list[int], max_drafts: int, vocab: int,
                       device: torch.device, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uniform [N, K], noise [N, V])`` for :func:`accept_drafts`: one draw each from ``generator``
    for unseeded requests; a seeded request draws its noise, then its uniforms, from the generator
    of ``(seed, output index of the step's first token)``."""
    num = len(options)
    uniform = torch.rand(num, max_drafts, device=device, generator=generator)
    noise = torch.empty(num, vocab, device=device).exponential_(generator=generator)
    for row, (option, index) in enumerate(zip(options, output_indices)):
        if option.seed is not None:
            gen = seeded_generator(option.seed, index, device=device)
            noise[row].exponential_(generator=gen)
            uniform[row] = torch.rand(max_drafts, device=device, generator=gen)
    return uniform, noise


def verify_step(logits: torch.Tensor, sampling: list[ScheduledRequest], options: list[SamplingOptions],
                draft_probs: torch.Tensor | None, generator: torch.Generator | None = None,
                logprob_logits: torch.Tensor | None = None) -> list[list[SampledToken]]:
    """Rank 0's verification of the requests of a step that verify drafts.

    Args:
        logits: ``[sum(1 + num_spec_tokens), V]`` float32: per request, its ``num_spec_tokens + 1``
            last rows in order (after grammar masks and penalties; the filters of each request's
            options apply here).
        sampling: the requests (``num_spec_tokens >= 1`` each; ``draft_probs_row`` names their row
            of ``draft_probs`` when sampled).
        options: their sampling settings.
        draft_probs: ``[rows, K_max, V]`` float32, the draft worker's ``q`` buffer (None when every
            request is greedy).
        generator: noise for unseeded requests.
        logprob_logits: the raw model logits, same shape as ``logits``, whose logprobs are
            reported (default: ``logits``).

    Returns:
        Per request, in order, a list: its accepted drafts and then the bonus or corrected token
        (with logprobs under the raw target distribution when the request asked).

    Raises:
        AssertionError: the logits do not have one row per verified position.
    """
    device, vocab = logits.device, logits.shape[1]
    counts = [sched.num_spec_tokens for sched in sampling]
    max_drafts = max(counts)
    layout, drafts, row = [], [], 0                     # [N, K + 1] logits row of each position (padded)
    for sched, count in zip(sampling, counts):
        layout.append([row + min(j, count) for j in range(max_drafts + 1)])
        drafts.append(sched.token_ids[-count:] + [0] * (max_drafts - count))
        row += count + 1
    assert row == logits.shape[0], f"{logits.shape[0]} logit rows, expected {row}"
    num = len(sampling)
    q_rows = [max(sched.draft_probs_row, 0) for sched in sampling]
    flat = torch.tensor([v for r in layout for v in r] + [v for r in drafts for v in r] + counts + q_rows,
                        dtype=torch.int64).to(device)                                 # one upload
    index, draft_ids, num_drafts, q_rows = flat.split([num * (max_drafts + 1), num * max_drafts, num, num])
    index, draft_ids = index.view(num, max_drafts + 1), draft_ids.view(num, max_drafts)
    padded = logits[index]                                                            # [N, K + 1, V]
    greedy_rows = [is_greedy(option) for option in options]
    target_probs = q = None
    if not all(greedy_rows):
        settings = [option if not greedy else SamplingOptions(temperature=1.0)
                    for option, greedy in zip(options, greedy_rows)]
        target_probs = sampling_probs(padded.flatten(0, 1), [s for s in settings for _ in range(max_drafts + 1)])
        target_probs = target_probs.view(num, max_drafts + 1, vocab)
        q = draft_probs.index_select(0, q_rows)[:, :max_drafts]                       # [N, K, V]
    uniform, noise = verification_noise(options, [s.output_index for s in sampling], max_drafts, vocab, device,
                                        generator)
    tokens, num_emitted = accept_drafts(padded.argmax(dim=-1), target_probs, draft_ids, num_drafts, q,
                                        torch.tensor(greedy_rows, device=device), uniform, noise)
    host = torch.cat((tokens, num_emitted[:, None]), dim=1).tolist()                 # the step's one read-back
    out: list[list[SampledToken]] = []
    raw = None
    for i, (sched, option) in enumerate(zip(sampling, options)):
        emitted = host[i][:host[i][-1]]
        if option.logprobs is not None and raw is None:
            raw = padded if logprob_logits is None else logprob_logits[index]
        logprobs = raw[i, :len(emitted)].log_softmax(dim=-1) if option.logprobs is not None else logits.new_empty(0)
        out.append(sampled_tokens([sched.req_id] * len(emitted), emitted, logprobs, [option] * len(emitted)))
    return out


def sample_with_drafts(logits: torch.Tensor, sampling: list[ScheduledRequest], options: list[SamplingOptions],
                       draft_probs: torch.Tensor | None, generator: torch.Generator | None = None,
                       logprob_logits: torch.Tensor | None = None) -> list[SampledToken]:
    """Rank 0's sampling for a step in which some requests verify drafts: plain requests through
    ``workers/sampler.py``'s :func:`sample`, the others through :func:`verify_step`.

    Args:
        logits: ``[sum(1 + num_spec_tokens), V]`` float32: per sampling request, its
            ``num_spec_tokens + 1`` last rows in order (after grammar masks and penalties).
        sampling: the plan's sampling requests. options: their settings.
        draft_probs: the draft worker's ``q`` buffer ``[rows, K_max, V]`` (None: every request greedy).
        generator: noise for unseeded requests.
        logprob_logits: the raw model logits, same shape, whose logprobs are reported (default: ``logits``).

    Returns:
        Per request, in order: its accepted drafts and then one sampled token (plain requests: one).
    """
    plain, spec, plain_rows, spec_rows, row = [], [], [], [], 0
    for i, sched in enumerate(sampling):
        if sched.num_spec_tokens:
            spec.append(i)
            spec_rows.extend(range(row, row + sched.num_spec_tokens + 1))
        else:
            plain.append(i)
            plain_rows.append(row)
        row += 1 + sched.num_spec_tokens
    assert row == logits.shape[0], f"{logits.shape[0]} logit rows, expected {row}"
    per_request: list[list[SampledToken]] = [[] for _ in sampling]
    raw = logits if logprob_logits is None else logprob_logits
    if plain:
        opts = [options[i] for i in plain]
        index = torch.tensor(plain_rows, device=logits.device)
        tokens, logprobs = sample(logits[index], opts, [sampling[i].output_index for i in plain], generator, raw[index])
        for i, out in zip(plain, sampled_tokens([sampling[i].req_id for i in plain], tokens, logprobs, opts)):
            per_request[i] = [out]
    if spec:
        index = torch.tensor(spec_rows, device=logits.device)
        verified = verify_step(logits[index], [sampling[i] for i in spec], [options[i] for i in spec], draft_probs,
                               generator, None if logprob_logits is None else logprob_logits[index])
        for i, tokens in zip(spec, verified):
            per_request[i] = tokens
    return [token for tokens in per_request for token in tokens]
