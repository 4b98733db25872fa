"""Rank 0's logits processing before sampling: structured-output token masks and sampling controls.

Applied to the logit rows of the requests that sample, in vLLM v1's order
(``Sampler.apply_logits_processors``): the grammar's token bitmask (xgrammar), then
``allowed_token_ids`` and ``bad_words``, then ``min_tokens`` and ``logit_bias``, then the
penalties (vLLM's ``apply_penalties``)::

    logits[t] = logits[t] / r   if t in prompt or output and logits[t] > 0      (repetition, r > 0)
    logits[t] = logits[t] * r   if t in prompt or output and logits[t] <= 0
    logits[t] -= frequency_penalty * count_output[t] + presence_penalty * (count_output[t] > 0)   (OpenAI)

The processed rows are what plain sampling, greedy verification and rejection sampling draw from
(temperature and the top-k / top-p / min-p filters come after), so speculative decoding keeps the
target distribution exact: verification row ``j`` of a request counts its first ``j`` draft
tokens as output, as plain decoding would have after emitting them. Logprobs stay those of the
raw model distribution (vLLM's default ``raw_logprobs``).

State lives on the device, one pool slot per request with controls: output token counts
``[slots, vocab]`` int32, prompt membership ``[slots, vocab]`` bool, a static additive row
``[slots, vocab]`` float32 (``logit_bias``; ``-inf`` outside ``allowed_token_ids`` and at
one-token bad words) and the three penalties ``[slots, 3]``. A step gathers its rows' slots and
updates counts with one scatter of the emitted tokens; host work per step is a few index lists.
Only multi-token bad words compare the last tokens on the host (rank 0 keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardserve.workers.messages import SampledToken, SamplingOptions, ScheduledRequest

_NEG_INF = float("-inf")


def apply_token_bitmasks(logits: torch.Tensor, sampling: list[ScheduledRequest]) -> None:
    """Set to ``-inf``, in place, every logit a request's grammar forbids at that row.

    Args:
        logits: ``[sum(1 + num_spec_tokens), V]`` float32, per sampling request its rows in order.
        sampling: the plan's sampling requests; ``token_bitmask`` ``[1 + num_spec_tokens, ceil(V/32)]``
            int32 or None.
    """
    rows, masks, row = [], [], 0
    for sched in sampling:
        num_rows = 1 + sched.num_spec_tokens
        if sched.token_bitmask is not None:
            rows.extend(range(row, row + num_rows))
            masks.append(sched.token_bitmask)
        row += num_rows
    if not rows:
        return
    import xgrammar as xgr

    # xgrammar indexes the bitmask and the logits by the same rows: a full-height mask, ones elsewhere.
    full = torch.full((logits.shape[0], masks[0].shape[1]), -1, dtype=torch.int32)
    full[rows] = torch.cat(masks)
    vocab_size = logits.shape[1]
    if vocab_size % 32:
        # NOTE: xgrammar 0.2.8's CPU kernel writes -inf past a row's end (into the next row) for
        # zero bits beyond vocab_size in the last word: set those bits.
        full[:, vocab_size // 32] |= torch.tensor(~((1 << vocab_size % 32) - 1) & 0xFFFFFFFF).to(torch.int32)
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), vocab_size=vocab_size,
                                    indices=rows)


@dataclass(slots=True)
class _Controls:
    """Host side of one request's controls."""

    options: SamplingOptions
    slot: int
    multi_bad_words: list[list[int]] = field(default_factory=list)   # bad words of 2+ tokens
    recent: list[int] = field(default_factory=list)                   # last output tokens (bad words)
    history_len: int = 0                                              # how many of them to keep


class SamplingControls:
    """Rank 0's per-request control state and its application (see the module docstring).

    Args:
        vocab_size: logit columns.
        device: where the logits and the state live.
        capacity: initial slots (doubled when full).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.requests: dict[str, _Controls] = {}
        self._free: list[int] = []
        self._grow(capacity)

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        old = getattr(self, "counts", None)
        size = 0 if old is None else old.shape[0]
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        static = torch.zeros(capacity, self.vocab_size, dtype=torch.float32, device=self.device)
        penalties = torch.zeros(capacity, 3, dtype=torch.float32, device=self.device)   # presence, frequency, rep.
        if old is not None:
            counts[:size], prompt[:size], static[:size], penalties[:size] = \
                self.counts, self.prompt, self.static, self.penalties
        self.counts, self.prompt, self.static, self.penalties = counts, prompt, static, penalties
        self._free += list(range(capacity - 1, size - 1, -1))

    # -- request lifecycle ---------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, req_id: str, options: SamplingOptions, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Take a slot for a request with controls and fill it from its tokens so far.

        Args:
            token_ids: prompt + output so far (the output is not empty after a preemption).
            num_prompt_tokens: how many of them are the prompt.
        """
        self.remove(req_id)
        if not self._free:
            self._grow(2 * self.counts.shape[0])
        slot = self._free.pop()
        device = self.device
        prompt_ids = torch.tensor(token_ids[:num_prompt_tokens], dtype=torch.long, device=device)
        output_ids = torch.tensor(token_ids[num_prompt_tokens:], dtype=torch.long, device=device)
        self.counts[slot].zero_().index_put_((output_ids,), torch.ones_like(output_ids, dtype=torch.int32),
                                             accumulate=True)
        self.prompt[slot].zero_()[prompt_ids] = True
        static = self.static[slot]
        static.fill_(_NEG_INF if options.allowed_token_ids is not None else 0.0)
        if options.allowed_token_ids is not None:
            static[torch.tensor(options.allowed_token_ids, dtype=torch.long, device=device)] = 0.0
        words = options.bad_words_ids or []
        single = [ids[0] for ids in words if len(ids) == 1]
        if single:
            static[torch.tensor(single, dtype=torch.long, device=device)] = _NEG_INF
        if options.logit_bias:
            ids = torch.tensor(list(options.logit_bias), dtype=torch.long, device=device)
            static.index_put_((ids,), torch.tensor(list(options.logit_bias.values()), dtype=torch.float32,
                                                   device=device), accumulate=True)
        self.penalties[slot] = torch.tensor([options.presence_penalty, options.frequency_penalty,
                                             options.repetition_penalty], device=device)
        multi = [ids for ids in words if len(ids) > 1]
        keep = max((len(ids) - 1 for ids in multi), default=0)
        recent = token_ids[num_prompt_tokens:][-keep:] if keep else []
        self.requests[req_id] = _Controls(options, slot, multi, recent, keep)

    def remove(self, req_id: str) -> None:
        """Give a request's slot back (no-op for requests without controls)."""
        controls = self.requests.pop(req_id, None)
        if controls is not None:
            self._free.append(controls.slot)

    @torch.inference_mode()
    def record(self, sampled: list[SampledToken]) -> None:
        """Count the tokens rank 0 emitted this step (accepted drafts and the sampled token)."""
        slots, tokens = [], []
        for token in sampled:
            controls = self.requests.get(token.req_id)
            if controls is None:
                continue
            slots.append(controls.slot)
            tokens.append(token.token_id)
            if controls.history_len:
                controls.recent = (controls.recent + [token.token_id])[-controls.history_len:]
        if slots:
            index = torch.tensor([slots, tokens], dtype=torch.long).to(self.device, non_blocking=True)
            self.counts.index_put_((index[0], index[1]), torch.ones(len(slots), dtype=torch.int32, device=self.device),
                                   accumulate=True)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, sampling: list[ScheduledRequest]) -> None:
        """Apply the controls to the rows of the requests that have them, in place.

        Args:
            logits: ``[sum(1 + num_spec_tokens), V]`` float32 (grammar masks already applied).
            sampling: the plan's sampling requests, in row order.
        """
        rows, slots = [], []
        draft_pairs: list[tuple[int, int]] = []     # (index into rows, draft token counted as output)
        forbid_pairs: list[tuple[int, int]] = []    # (index into rows, token) bad-word completions
        hold_pairs: list[tuple[int, int]] = []      # (index into rows, token) min_tokens stops
        row = 0
        for sched in sampling:
            num_rows = 1 + sched.num_spec_tokens
            controls = self.requests.get(sched.req_id)
            if controls is not None:
                drafts = sched.token_ids[len(sched.token_ids) - sched.num_spec_tokens:]
                for j in range(num_rows):
                    at = len(rows)
                    rows.append(row + j)
                    slots.append(controls.slot)
                    draft_pairs += [(at, token) for token in drafts[:j]]
                    if controls.multi_bad_words:
                        forbid_pairs += [(at, t) for t in _completions(controls, drafts[:j])]
                    if sched.output_index + j < controls.options.min_tokens:
                        hold_pairs += [(at, t) for t in controls.options.min_stop_ids or ()]
            row += num_rows
        if not rows:
            return
        device = logits.device
        index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        slot_index = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        sub = logits[index] + self.static[slot_index]                                  # [P, V]
        if forbid_pairs:
            at = torch.tensor(forbid_pairs, dtype=torch.long).to(device, non_blocking=True)
            sub[at[:, 0], at[:, 1]] = _NEG_INF
        if hold_pairs:
            sub = _hold_back(sub, torch.tensor(hold_pairs, dtype=torch.long).to(device, non_blocking=True))
        counts = self.counts[slot_index]                                               # [P, V] int32
        if draft_pairs:
            at = torch.tensor(draft_pairs, dtype=torch.long).to(device, non_blocking=True)
            counts.index_put_((at[:, 0], at[:, 1]), torch.ones(len(draft_pairs), dtype=torch.int32, device=device),
                              accumulate=True)
        logits[index] = apply_penalties(sub, self.prompt[slot_index], counts, self.penalties[slot_index])


def _completions(controls: _Controls, drafts: list[int]) -> list[int]:
    """Last tokens of multi-token bad words whose other tokens end the output (+ ``drafts``)."""
    recent = (controls.recent + drafts)[-controls.history_len:] if controls.history_len else []
    return [ids[-1] for ids in controls.multi_bad_words
            if len(recent) >= len(ids) - 1 and recent[len(recent) - len(ids) + 1:] == ids[:-1]]


def _hold_back(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``min_tokens``: forbid ``(row, token)`` pairs, except in a row they would empty (a grammar
    that allows only EOS there: its mask wins)."""
    held = logits.clone()
    held[pairs[:, 0], pairs[:, 1]] = _NEG_INF
    possible = torch.isfinite(held).any(dim=-1, keepdim=True)
    return torch.where(possible, held, logits)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    penalties: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's ``apply_penalties``; OpenAI's
    definition for frequency / presence).

    Args:
        logits: ``[P, V]`` float32. prompt_mask: ``[P, V]`` bool, token in the prompt.
        output_counts: ``[P, V]`` int32, occurrences in the output so far.
        penalties: ``[P, 3]`` float32: presence, frequency, repetition (1 = off).

    Returns:
        ``[P, V]`` float32 penalized logits (``-inf`` stays ``-inf``).
    """
    in_output = output_counts > 0
    repetition = penalties[:, 2:3]
    scale = torch.where(logits > 0, 1.0 / repetition, repetition)
    logits = torch.where(prompt_mask | in_output, logits * scale, logits)
    return logits - penalties[:, 1:2] * output_counts - penalties[:, 0:1] * in_output
