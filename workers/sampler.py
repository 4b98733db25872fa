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


def _row_params(options: list[SamplingOptions], rows: list[int], device: torch.device) -> torch.Tensor:
    """``[5, N]`` float32 on ``device``: per row its temperature, top-k, top-p, min-p and its row
    index ``rows[i]``, in one copy (from pinned memory on CUDA: the host does not wait)."""
    host = torch.tensor([[o.temperature, o.top_k, o.top_p, o.min_p, row] for o, row in zip(options, rows)],
                        dtype=torch.float32).T.contiguous()
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _probs(logits: torch.Tensor, options: list[SamplingOptions], params: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p, then softmax, per row (``params``: :func:`_row_params`)."""
    scaled = logits / params[0][:, None]
    if any(o.top_k > 0 or o.top_p < 1.0 or o.min_p > 0.0 for o in options):
        scaled = filter_logits(scaled, params[1].long(), params[2], params[3])
    return scaled.softmax(dim=-1)


def sampling_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k/top-p/min-p.

    Args:
        logits: ``[N, V]`` float32 raw logits. options: per-row settings (temperature > 0).

    Returns:
        ``[N, V]`` float32 probabilities (zero outside each row's kept set).
    """
    return _probs(logits, options, _row_params(options, list(range(len(options))), logits.device))


def _noise(options: list[SamplingOptions], output_indices: list[int], vocab: int, device: torch.device,
           generator: torch.Generator | None) -> torch.Tensor:
    """``Exp(1)`` noise ``[N, V]`` for the exponential race of ``N`` random rows: the unseeded ones
    from one draw of ``generator`` (in row order), a seeded one from its ``(seed, output index)``
    generator; assembled by one ``cat``."""
    unseeded = sum(o.seed is None for o in options)
    if unseeded == len(options):
        return torch.empty(unseeded, vocab, device=device).exponential_(generator=generator)
    shared = iter(torch.empty(unseeded, vocab, device=device).exponential_(generator=generator) if unseeded else ())
    return torch.cat([next(shared)[None] if o.seed is None else   # a seeded row: (seed, output index) only
                      torch.empty(1, vocab, device=device).exponential_(
                          generator=seeded_generator(o.seed, index, device=device))
                      for o, index in zip(options, output_indices)])


def sample_on_device(logits: torch.Tensor, options: list[SamplingOptions], output_indices: list[int],
                     generator: torch.Generator | None = None, logprob_logits: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row, on the logits' device, without reading anything back: greedy rows
    take the argmax, the others race their filtered probabilities against ``Exp(1)`` noise (no
    Python branching on device values; the random rows' settings and indices cross in one copy).

    Args:
        logits: ``[N, V]`` float32 model logits (after grammar masks and penalties, if any).
        options: per-row sampling options.
        output_indices: per-row index of the output token being drawn (seeded streams).
        generator: source of noise for unseeded rows (None: torch's default).
        logprob_logits: ``[N, V]`` the raw logits whose logprobs are reported (default: ``logits``).

    Returns:
        ``(token ids [N] int64, log_softmax of the raw logits [N, V] or an empty tensor if no row
        asked)``, both on the logits' device.
    """
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, o in enumerate(options) if not is_greedy(o)]
    if random_rows:
        opts = [options[i] for i in random_rows]
        params = _row_params(opts, random_rows, logits.device)
        every_row = len(random_rows) == len(options)
        rows = params[4].long()
        probs = _probs(logits if every_row else logits.index_select(0, rows), opts, params)
        noise = _noise(opts, [output_indices[i] for i in random_rows], logits.shape[1], logits.device, generator)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = sampled if every_row else tokens.index_copy(0, rows, sampled)
    want_logprobs = any(o.logprobs is not None for o in options)
    raw = logits if logprob_logits is None else logprob_logits
    return tokens, raw.log_softmax(dim=-1) if want_logprobs else logits.new_empty(0)


def sample(logits: torch.Tensor, options: list[SamplingOptions], output_indices: list[int],
           generator: torch.Generator | None = None, logprob_logits: torch.Tensor | None = None,
           ) -> tuple[list[int], torch.Tensor]:
    """:func:`sample_on_device` with the token ids read back: ``(token ids, logprobs [N, V] or an
    empty tensor)``."""
    tokens, logprobs = sample_on_device(logits, options, output_indices, generator, logprob_logits)
    return tokens.tolist(), logprobs


def sampled_tokens(req_ids: list[str], tokens: list[int] | torch.Tensor, logprobs: torch.Tensor,
                   options: list[SamplingOptions]) -> list[SampledToken]:
    """Pack sampler output with the logprobs each request asked for.

    ``tokens`` may be host ids or the device ids of :func:`sample_on_device`: the tokens, the chosen
    tokens' logprobs and every row's top-N cross to the host in one transfer.
    """
    if all(opt.logprobs is None for opt in options):
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        return [SampledToken(req_id, token) for req_id, token in zip(req_ids, ids)]
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(tokens, device=logprobs.device)
    width = max(opt.logprobs or 0 for opt in options)
    picked = logprobs.gather(1, tokens[:, None])                                           # [N, 1]
    values, ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0].long())
    # NOTE: float64 holds every token id exactly: one [N, 2 + 2 * width] transfer.
    host = torch.cat((tokens[:, None].double(), picked.double(), values.double(), ids.double()), dim=1).cpu().tolist()
    out = []
    for req_id, row, opt in zip(req_ids, host, options):
        if opt.logprobs is None:
            out.append(SampledToken(req_id, int(row[0])))
            continue
        top = list(zip((int(i) for i in row[2 + width:2 + width + opt.logprobs]), row[2:2 + opt.logprobs]))
        out.append(SampledToken(req_id, int(row[0]), row[1], top))
    return out
