"""A request's grammar state in the engine: the xgrammar matcher its output advances, and the
token bitmasks it sends to rank 0 (vLLM v1's design: the matchers live beside the scheduler).

Per step, each constrained request that samples gets a ``[num_spec_tokens + 1, ceil(vocab / 32)]``
int32 bitmask in its :class:`workers.messages.ScheduledRequest`: row ``j`` allows the tokens the
grammar accepts after the output so far plus the first ``j`` draft tokens (the matcher advances
through the drafts, fills each row, and rolls back). Rank 0 sets every other logit to ``-inf``
before penalties and sampling, so plain sampling, greedy verification and rejection sampling all
draw from the constrained target distribution; drafts are checked against the grammar before
they are scheduled (the first one it rejects ends them). The matcher accepts each token the
engine appends (:meth:`GrammarState.accept`); a rejected draft never reaches it.

A constraint may start later (``StructuredOutputs.start_after``: the reasoning parser's end marker,
e.g. ``</think>``, vLLM's structured outputs with a reasoning parser): until the output contains
that token sequence the request samples freely (no bitmask, no draft check), and the grammar
applies from the token after it, also when the marker ends inside a step's drafts.

With async scheduling a constrained request does not run ahead (``Request.may_sample_more``):
its next mask needs the token still being sampled. Preemption keeps the matcher as it is (the
output stays); finishing, aborting or failing a request drops it (``Scheduler.finish``).
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet = weakref.WeakSet()   # every matcher not yet collected: leak checks (ModelInfo)


def num_live_grammars() -> int:
    """Grammar matchers alive in this process (0 once every constrained request has ended)."""
    return len(_LIVE)


class GrammarState:
    """One request's matcher.

    Args:
        compiled: ``xgrammar.CompiledGrammar`` (``cluster/frontend/structured.py``).
        vocab_size: the model's vocabulary (bitmask width ``ceil(vocab_size / 32)``).
        start_after: the grammar applies once the output contains these token ids (in a row);
            empty = from the first output token.
    """

    def __init__(self, compiled, vocab_size: int, start_after: tuple[int, ...] = ()) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.start_after = tuple(start_after)
        self.started = not self.start_after
        self._tail: list[int] = []   # the last output tokens while the marker is awaited
        _LIVE.add(self)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.started and self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False (matcher unchanged) when the grammar forbids it."""
        if self.started:
            return self.matcher.accept_token(token_id)
        self._tail = (self._tail + [token_id])[-len(self.start_after):]
        self.started = tuple(self._tail) == self.start_after
        return True

    def _free_drafts(self, draft_ids: list[int]) -> int | None:
        """How many leading drafts come before the grammar starts (0 once started; None: the
        marker does not complete within ``draft_ids``)."""
        if self.started:
            return 0
        tail, n = list(self._tail), len(self.start_after)
        for i, token in enumerate(draft_ids):
            tail = (tail + [token])[-n:]
            if tuple(tail) == self.start_after:
                return i + 1
        return None

    def valid_prefix(self, draft_ids: list[int]) -> int:
        """How many leading drafts the grammar accepts (the matcher is left as it was)."""
        free = self._free_drafts(draft_ids)
        if free is None:
            return len(draft_ids)
        return free + self._valid_prefix(draft_ids[free:])

    def _valid_prefix(self, draft_ids: list[int]) -> int:
        accepted = 0
        for token in draft_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def bitmask(self, draft_ids: list[int]) -> torch.Tensor | None:
        """Rows ``0..len(draft_ids)`` of allowed tokens (row ``j``: after the first ``j`` drafts).

        Returns:
            ``[len(draft_ids) + 1, ceil(vocab_size / 32)]`` int32 CPU tensor; bit ``t % 32`` of
            word ``t // 32`` is 1 when token ``t`` is allowed. Rows after a draft the grammar
            rejects, and rows before the grammar starts, allow everything: verification never
            reaches the former. None: the grammar does not start within these rows.
        """
        import xgrammar as xgr

        free = self._free_drafts(draft_ids)
        if free is None:
            return None
        mask = xgr.allocate_token_bitmask(len(draft_ids) + 1, self.vocab_size)   # all ones
        accepted = 0
        for row in range(free, len(draft_ids) + 1):
            self.matcher.fill_next_token_bitmask(mask, row)
            if row == len(draft_ids) or not self.matcher.accept_token(draft_ids[row]):
                break
            accepted += 1
            if self.matcher.is_terminated():   # a draft stop token: the request ends there
                break
        if accepted:
            self.matcher.rollback(accepted)
        return mask
