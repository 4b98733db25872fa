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
    """

    def __init__(self, compiled, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        _LIVE.add(self)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False (matcher unchanged) when the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    def valid_prefix(self, draft_ids: list[int]) -> int:
        """How many leading drafts the grammar accepts (the matcher is left as it was)."""
        accepted = 0
        for token in draft_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def bitmask(self, draft_ids: list[int]) -> torch.Tensor:
        """Rows ``0..len(draft_ids)`` of allowed tokens (row ``j``: after the first ``j`` drafts).

        Returns:
            ``[len(draft_ids) + 1, ceil(vocab_size / 32)]`` int32 CPU tensor; bit ``t % 32`` of
            word ``t // 32`` is 1 when token ``t`` is allowed. Rows after a draft the grammar
            rejects allow everything: verification never reaches them.
        """
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(draft_ids) + 1, self.vocab_size)   # all ones
        accepted = 0
        for row in range(len(draft_ids) + 1):
            self.matcher.fill_next_token_bitmask(mask, row)
            if row == len(draft_ids) or not self.matcher.accept_token(draft_ids[row]):
                break
            accepted += 1
            if self.matcher.is_terminated():   # a draft stop token: the request ends there
                break
        if accepted:
            self.matcher.rollback(accepted)
        return mask
