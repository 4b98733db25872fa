"""What crosses the coordinator -> worker boundary each step (plain, cheaply pickled dataclasses).

The coordinator sends a :class:`StepPlan` per engine step; workers keep per-request state (block
table, sampling options) and apply the plan as a diff: new requests arrive in full once, then each
step carries only the tokens to compute and the blocks added since the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingOptions:
    """Per-request sampling settings the sampler on rank 0 needs."""

    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # nucleus mass kept, (0, 1]
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0              # drop tokens with prob < min_p * max prob
    seed: int | None = None         # per-request seed; None = engine's global generator
    logprobs: int | None = None     # None = no logprobs; N >= 0: chosen token's logprob plus top-N
    # Sampling controls (workers/logits_processors.py), applied before temperature and the filters:
    presence_penalty: float = 0.0   # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # logit / p (> 0) or * p (< 0) for tokens in prompt or output; 1 = off
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    min_tokens: int = 0             # min_stop_ids are forbidden at output indices below this
    min_stop_ids: list[int] | None = None
    bad_words_ids: list[list[int]] | None = None  # token sequences never completed
    allowed_token_ids: list[int] | None = None   # only these tokens; None = all

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def has_controls(self) -> bool:
        """Any control set: rank 0 keeps state for the request."""
        return self.has_penalties or bool(self.logit_bias or self.min_tokens or self.bad_words_ids) \
            or self.allowed_token_ids is not None


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen (or see again after preemption)."""

    req_id: str                     # unique while the request lives
    sampling: SamplingOptions       # used by rank 0 only
    state_slot: int | None = None   # recurrent-state slot (hybrid models, cluster/engine/state_slots.py); None otherwise
    # Rank 0's sampling controls (penalties, bad words) need the tokens so far: prompt + output
    # (the output is not empty after a preemption); None when the request has no controls.
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0


PLACEHOLDER_TOKEN = -1   # a token_ids entry rank 0 fills with its last sample for the request (async scheduling)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in this step."""

    req_id: str
    token_ids: list[int]            # tokens to compute this step (prefill chunk, or 1 for decode); a decode's
                                    # one token may be PLACEHOLDER_TOKEN: the last token rank 0 sampled for it
    start_pos: int                  # position of token_ids[0] == tokens already in the KV cache
    new_block_ids: list[int]        # blocks appended to the request's block table this step
    sample: bool                    # True when this step reaches the last known token
    output_index: int               # index of the token to sample among the outputs (seeded RNG stream)
    num_spec_tokens: int = 0        # the last num_spec_tokens of token_ids are draft tokens to verify
    draft_probs_row: int = -1       # row of the draft worker's q buffer holding their draft distributions
                                    # [K_max, vocab] (workers/draft_buffers.py); -1: greedy, no q
    token_bitmask: object = None    # structured outputs: [num_spec_tokens + 1, ceil(vocab / 32)] int32 tokens
                                    # allowed at each sampled row (cluster/engine/grammar.py); None: all


@dataclass(slots=True)
class StepPlan:
    """Everything the workers need for one forward step."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # forget these before scheduling
    return_logits: bool = False     # rank 0 also returns the raw logits (tests, debugging)
    return_hidden: bool = False     # rank 0 also returns every computed token's final hidden state (MTP)


@dataclass(slots=True)
class DataParallelPlan:
    """One engine step of a replica with data-parallel attention (issue 29): one :class:`StepPlan`
    per attention group, every rank receives all of them. A rank applies and computes its own
    group's plan (``plans[group]``); the others' token counts size the MoE exchange
    (``workers/models/moe_exchange.py``). A group with nothing to do gets an empty plan and still
    joins every MoE collective with zero rows. Each group's first rank returns that group's
    :class:`StepResult`."""

    plans: list[StepPlan] = field(default_factory=list)   # [attention_dp_size], group order

    @property
    def token_counts(self) -> list[int]:
        """Tokens each group computes this step (host ints, no device read)."""
        return [sum(len(s.token_ids) for s in plan.scheduled) for plan in self.plans]

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every group's scheduled requests, in group order (step timing and logs)."""
        return [sched for plan in self.plans for sched in plan.scheduled]


@dataclass(slots=True)
class SampledToken:
    """Rank 0's sample for one request."""

    req_id: str
    token_id: int
    logprob: float | None = None                       # log p(token) under the raw model distribution
    top_logprobs: list[tuple[int, float]] | None = None  # [(token_id, logprob)] best first


@dataclass(slots=True)
class StepResult:
    """Rank 0's answer to a :class:`StepPlan`."""

    # One entry per sampling request; a request that verified drafts gets its accepted drafts and
    # then the bonus/corrected token, consecutive and in order (1 to num_spec_tokens + 1 entries).
    sampled: list[SampledToken] = field(default_factory=list)
    logits: object = None           # [num_logit_rows, vocab] float32 torch tensor when the plan asked
    hidden_states: object = None    # [num_tokens, hidden] in plan order when plan.return_hidden and no
                                    # draft buffers are attached (else rank 0 wrote them there)
    execute_s: float = 0.0          # rank 0's wall time inside execute (s)
    collective_s: float = 0.0       # of which in TP collectives (all-reduce / all-gather), s


@dataclass(slots=True)
class DataParallelResult:
    """The answer to a :class:`DataParallelPlan`: each attention group's first rank's
    :class:`StepResult`, in group order (an idle group's has no samples)."""

    results: list[StepResult] = field(default_factory=list)

    @property
    def execute_s(self) -> float:
        """The slowest group's time inside execute (s): the groups wait for each other in the MoE."""
        return max((r.execute_s for r in self.results), default=0.0)

    @property
    def collective_s(self) -> float:
        """The largest of the groups' times inside collectives (s)."""
        return max((r.collective_s for r in self.results), default=0.0)


# -- draft model (MTP) boundary: coordinator -> DraftWorker ------------------------------------

@dataclass(slots=True)
class DraftRequest:
    """One request's MTP work: cache entries for the positions the target just verified, then
    (optionally) ``num_drafts`` chained draft tokens."""

    req_id: str
    token_ids: list[int]            # x_{t+1} for each entry t = start_pos .. start_pos + len - 1
    start_pos: int                  # first entry's position (== entries already in the MTP cache)
    new_block_ids: list[int]        # blocks appended to the request's block table since the last batch
    num_drafts: int                 # draft tokens to propose after the entries (0: only fill the cache)
    output_index: int               # output index of the first draft token (seeded RNG stream)


@dataclass(slots=True)
class DraftBatch:
    """Everything the draft worker needs for one drafting pass."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[DraftRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)   # forget these first
    hidden_rows: list[int] = field(default_factory=list)        # [sum(len(token_ids))] row of each entry's h_t
    hidden_states: object = None    # [rows, hidden] tensor the rows index; None: the shared hidden buffer


@dataclass(slots=True)
class DraftProposal:
    """Draft tokens for one request."""

    req_id: str
    token_ids: list[int]            # 1..num_drafts proposed tokens
    probs_row: int = -1             # row of the q buffer holding their distributions (-1: greedy)


@dataclass(slots=True)
class DraftResult:
    """The draft worker's answer to a :class:`DraftBatch` (requests with ``num_drafts > 0`` only)."""

    proposals: list[DraftProposal] = field(default_factory=list)
    seconds: float = 0.0            # the draft worker's time inside propose (s)
