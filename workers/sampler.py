"""Token sampling on rank 0: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Sampling uses the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws exactly from
``p`` (the Gumbel-max trick in another form; vLLM's sampler does the same). A seeded request draws
its noise from a generator keyed by ``(seed, output_index)``, so its tokens do not depend on which
other requests share the batch, on preemption, or on how many steps it took.
Filter order follows transformers' logits warpers: temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import torch

from workers.messages import SampledToken, SamplingOptions

_GREEDY_EPS = 1e-5
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant; spreads (seed, index) over the 63-bit seed space


def seeded_generator(seed: int, output_index: int) -> torch.Generator:
    """A CPU generator for output token ``output_index`` of a request seeded with ``seed``."""
    return torch.Generator().manual_seed((seed * _MIX + output_index) % (1 << 63))


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


def sample(logits: torch.Tensor, options: list[SamplingOptions], output_indices: list[int],
           generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: ``[N, V]`` float32 raw model logits.
        options: per-row sampling options.
        output_indices: per-row index of the output token being drawn (seeded streams).
        generator: source of noise for unseeded rows (None: torch's default).

    Returns:
        ``(token ids, log_softmax of the raw logits [N, V] or an empty tensor if no row asked)``.
    """
    num_rows = logits.shape[0]
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, o in enumerate(options) if o.temperature > _GREEDY_EPS]
    if random_rows:
        idx = torch.tensor(random_rows)
        opts = [options[i] for i in random_rows]
        scaled = logits[idx] / torch.tensor([o.temperature for o in opts])[:, None]
        if any(o.top_k > 0 or o.top_p < 1.0 or o.min_p > 0.0 for o in opts):
            scaled = filter_logits(scaled, torch.tensor([o.top_k for o in opts]),
                                   torch.tensor([o.top_p for o in opts]), torch.tensor([o.min_p for o in opts]))
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, (i, o) in enumerate(zip(random_rows, opts)):
            gen = generator if o.seed is None else seeded_generator(o.seed, output_indices[i])
            noise[row].exponential_(generator=gen)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    want_logprobs = any(o.logprobs is not None for o in options)
    logprobs = logits.log_softmax(dim=-1) if want_logprobs else logits.new_empty(0)
    assert tokens.shape[0] == num_rows
    return tokens.tolist(), logprobs


def sampled_tokens(req_ids: list[str], tokens: list[int], logprobs: torch.Tensor,
                   options: list[SamplingOptions]) -> list[SampledToken]:
    """Pack sampler output with the logprobs each request asked for."""
    out = []
    for row, (req_id, token, opt) in enumerate(zip(req_ids, tokens, options)):
        if opt.logprobs is None:
            out.append(SampledToken(req_id, token))
            continue
        row_lp = logprobs[row]
        top = []
        if opt.logprobs > 0:
            values, ids = row_lp.topk(opt.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        out.append(SampledToken(req_id, token, float(row_lp[token]), top))
    return out
