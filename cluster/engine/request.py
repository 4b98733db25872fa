"""A request's state inside the coordinator: tokens, progress, blocks, sampling settings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shardserve.workers.messages import SamplingOptions

# Limits every front end applies (HTTP as OpenAI does, gRPC and the CLI the same).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20


@dataclass(slots=True)
class SpecUsage:
    """One request's speculative decoding (vLLM's ``spec_decode`` counters, per request)."""

    num_drafts: int = 0              # steps that verified drafts for it
    num_draft_tokens: int = 0        # draft tokens verified
    num_accepted_tokens: int = 0     # of those, accepted

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verifying step (accepted drafts + 1); None before any draft was verified."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_length": self.acceptance_length}


class RequestStatus(enum.IntEnum):
    """Lifecycle; every status above PREEMPTED is final (vLLM's ordering trick)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(slots=True)
class SamplingParams:
    """What a user asks for (OpenAI / vLLM semantics).

    Attributes:
        max_tokens: output tokens at most (>= 1); None = up to the context length.
        temperature: in [0, 2]; 0 = greedy. top_p in (0, 1]. top_k: 0 or -1 = off. min_p in [0, 1].
        seed: per-request seed, makes sampling reproducible.
        stop: at most 4 strings that end the output (not included in it).
        stop_token_ids: token ids that end the output (in addition to EOS unless ignore_eos).
        logprobs: None, or N >= 0 = the chosen token's logprob plus the top-N.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    def sampling_options(self) -> SamplingOptions:
        """The subset rank 0's sampler needs."""
        return SamplingOptions(self.temperature, self.top_p, max(self.top_k, 0), self.min_p, self.seed, self.logprobs)


@dataclass(slots=True)
class Logprob:
    """Logprob of one emitted token and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Request:
    """One generation request. ``num_computed_tokens`` chases ``num_tokens`` (vLLM's scheduling rule):
    prefill, chunked prefill, prefix-cache hits and decode are all "compute the missing tokens".
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0          # leading blocks already registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    sent_to_workers: bool = False       # workers hold state for it (cleared on preemption)
    num_sent_blocks: int = 0            # how many of block_ids the workers have been told about
    state_slot: int | None = None       # recurrent-state slot of hybrid models (cluster/engine/state_slots.py)
    # Speculative decoding: draft tokens proposed after the last output token, verified (and then
    # cleared) by the next step that schedules this request; never part of the output until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs_row: int = -1            # row of the draft's q buffer holding their distributions; -1 = greedy
    spec: SpecUsage | None = None       # acceptance counts (speculation on), reported in the final usage
    # Async scheduling: tokens being sampled by steps in flight (scheduled, result not back yet).
    # The next step computes such a token at its position before the coordinator knows it: the plan
    # carries PLACEHOLDER_TOKEN there and rank 0 puts in the token it sampled for the request.
    num_placeholders: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens once the steps in flight are back: :attr:`num_tokens` plus the placeholders."""
        return self.num_tokens + self.num_placeholders

    def may_sample_more(self, max_model_len: int) -> bool:
        """False when the tokens in flight already reach ``max_tokens`` or ``max_model_len``: one
        more step would compute a token the length check is bound to drop."""
        if not self.num_placeholders:
            return True
        max_tokens = self.params.max_tokens
        return ((max_tokens is None or self.num_output_tokens + self.num_placeholders < max_tokens)
                and self.num_known_tokens < max_model_len)
