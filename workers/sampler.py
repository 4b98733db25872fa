"""Token sampling on rank 0: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Sampling uses the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws exactly from
``p`` (the Gumbel-max trick in another form; vLLM's sampler does the same). A seeded request draws
its noise from a generator keyed by ``(seed, output_index)``, so its tokens do not depend on which
other requests share the batch, on preemption, or on how many steps it took.
Filter order follows transformers' logits warpers: temperature, top-k, top-p, min-p.

Speculative decoding's draft sampling and verification (rejection sampling) live in
``workers/rejection_sampler.py``; they draw from the same filtered distributions
(:func:`sampling_probs`) and seeded streams (:func:`seeded_generator`).
"""

from __future__ import annotations

import torch

from shardserve.workers.messages import SampledToken, SamplingOptions

_GREEDY_EPS = 1e-5
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant; spreads (seed, index) over the 63-bit seed space
DRAFT_STREAM = 0x5851F42D4C957F2D  # offset of the draft model's seeded streams from the target's


def seeded_generator(seed: int, output_index: int, stream: int = 0,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` for output token ``output_index`` of a request seeded with ``seed``
    (``stream=DRAFT_STREAM``: the draft model's generator for that token). CUDA and CPU generators
    draw different streams from one seed: a seed reproduces tokens on the same kind of device."""
    return torch.Generator(device=device).manual_seed((seed * _MIX + output_index + stream) % (1 << 63))


def is_greedy(option: SamplingOptions) -> bool:
    return option.temperature <= _GREEDY_EPS


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set.

    Args:
        logits: ``[N, V]`` float32, already divided by temperature.
        top_k: ``[N]`` int64, 0 = off. top_p: ``[N]`` float in (0, 1]. min_p: ``[N]`` float in [0, 1].

    Returns:
        ``[N, V]`` float32; every row keeps at least its best token.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k/top-p/min-p.

    Args:
        logits: ``[N, V]`` float32 raw logits. options: per-row settings (temperature > 0).

    Returns:
        ``[N, V]`` float32 probabilities (zero outside each row's kept set).
    """
    device = logits.device
    scaled = logits / torch.tensor([o.temperature for o in options], device=device)[:, None]
    if any(o.top_k > 0 or o.top_p < 1.0 or o.min_p > 0.0 for o in options):
        scaled = filter_logits(scaled, torch.tensor([o.top_k for o in options], device=device),
                               torch.tensor([o.top_p for o in options], device=device),
                               torch.tensor([o.min_p for o in options], device=device))
    return scaled.softmax(dim=-1)


def sample(logits: torch.Tensor, options: list[SamplingOptions], output_indices: list[int],
           generator: torch.Generator | None = None, logprob_logits: torch.Tensor | None = None,
           ) -> tuple[list[int], torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: ``[N, V]`` float32 model logits (after grammar masks and penalties, if any).
        options: per-row sampling options.
        output_indices: per-row index of the output token being drawn (seeded streams).
        generator: source of noise for unseeded rows (None: torch's default).
        logprob_logits: ``[N, V]`` the raw logits whose logprobs are reported (default: ``logits``).

    Returns:
        ``(token ids, log_softmax of the raw logits [N, V] or an empty tensor if no row asked)``.
    """
    num_rows = logits.shape[0]
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, o in enumerate(options) if o.temperature > _GREEDY_EPS]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        opts = [options[i] for i in random_rows]
        probs = sampling_probs(logits[idx], opts)
        noise = torch.empty_like(probs)
        unseeded = [row for row, o in enumerate(opts) if o.seed is None]
        if unseeded:   # one draw for all rows that share the engine's generator
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=generator)
        for row, (i, o) in enumerate(zip(random_rows, opts)):
            if o.seed is not None:   # a seeded row's noise depends only on (seed, output index)
                noise[row].exponential_(generator=seeded_generator(o.seed, output_indices[i], device=logits.device))
        tokens[idx] = (probs / noise).argmax(dim=-1)
    want_logprobs = any(o.logprobs is not None for o in options)
    raw = logits if logprob_logits is None else logprob_logits
    logprobs = raw.log_softmax(dim=-1) if want_logprobs else logits.new_empty(0)
    assert tokens.shape[0] == num_rows
    return tokens.tolist(), logprobs


def sampled_tokens(req_ids: list[str], tokens: list[int], logprobs: torch.Tensor,
                   options: list[SamplingOptions]) -> list[SampledToken]:
    """Pack sampler output with the logprobs each request asked for.

    The chosen tokens' logprobs and every row's top-N are picked on the logits' device and cross
    to the host in one transfer (not one per row).
    """
    wanted = [row for row, opt in enumerate(options) if opt.logprobs is not None]
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    if wanted:
        rows = logprobs[torch.tensor(wanted, device=logprobs.device)]                # [W, V]
        picked = rows.gather(1, torch.tensor([[tokens[r]] for r in wanted], device=rows.device))
        width = max(options[r].logprobs for r in wanted)
        values, ids = rows.topk(width, dim=-1) if width else (rows[:, :0], rows[:, :0].long())
        host = torch.cat((picked, values), dim=1).cpu()                               # [W, 1 + width]
        chosen, top_values, top_ids = host[:, 0].tolist(), host[:, 1:].tolist(), ids.cpu().tolist()
    out = []
    slot = {row: i for i, row in enumerate(wanted)}
    for row, (req_id, token, opt) in enumerate(zip(req_ids, tokens, options)):
        if opt.logprobs is None:
            out.append(SampledToken(req_id, token))
            continue
        i, count = slot[row], opt.logprobs
        out.append(SampledToken(req_id, token, chosen[i], list(zip(top_ids[i][:count], top_values[i][:count]))))
    return out
