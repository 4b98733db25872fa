"""A request's state inside the coordinator: tokens, progress, blocks, sampling settings."""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

from shardserve.workers.messages import SamplingOptions

# Limits every front end applies (HTTP as OpenAI does, gRPC and the CLI the same).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256       # each stop string is checked against the text after every token
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0            # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0       # |logit_bias| values (OpenAI's range)


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


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's ``structured_outputs``; OpenAI's ``response_format``).

    Frozen and hashable: it is the key of the compiled-grammar cache (``cluster/frontend/structured.py``).
    Build one with the constructors (:meth:`json_schema`, :meth:`json_object`, :meth:`regex`,
    :meth:`choice`, :meth:`grammar`) rather than by hand.

    Attributes:
        kind: ``"json"`` (a JSON schema), ``"json_object"`` (any JSON object), ``"regex"`` (the
            whole output matches the pattern), ``"choice"`` (the output is exactly one of the
            strings) or ``"grammar"`` (an EBNF grammar in xgrammar's / llama.cpp's GBNF dialect,
            start rule ``root``; text without ``::=`` is read as a Lark grammar, as vLLM does).
        value: ``json``: the schema as JSON text; ``regex``: the pattern; ``choice``: a tuple of
            strings; ``grammar``: the EBNF text; ``json_object``: None.
        disable_any_whitespace: JSON kinds: one fixed separator style (``", "`` and ``": "``, no
            newlines or indentation) instead of any whitespace (vLLM's field of that name, xgrammar's
            ``any_whitespace=False``). Small models otherwise may emit whitespace without end.
        start_after: the constraint applies after the output contains these token ids in a row
            (the reasoning parser's end of thinking, e.g. ``</think>``: the model thinks freely,
            then answers in the grammar); empty = from the first output token.

    Raises:
        ValueError: an unknown kind or a value of the wrong type (message names the kind).
    """

    kind: str
    value: str | tuple[str, ...] | None = None
    disable_any_whitespace: bool = False
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {list(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "json_object":
            ok = self.value is None
        elif self.kind == "choice":
            ok = isinstance(self.value, tuple) and bool(self.value) and all(isinstance(c, str) for c in self.value)
        else:
            ok = isinstance(self.value, str) and bool(self.value)
        if not ok:
            want = {"json_object": "no value", "choice": "a non-empty list of strings"}.get(self.kind, "a non-empty string")
            raise ValueError(f"structured output {self.kind!r} needs {want}, got {self.value!r}")
        if not isinstance(self.start_after, tuple) or not all(isinstance(t, int) and t >= 0 for t in self.start_after):
            raise ValueError(f"start_after must be a tuple of token ids, got {self.start_after!r}")

    @classmethod
    def json_schema(cls, schema: dict | str, disable_any_whitespace: bool = False) -> StructuredOutputs:
        """From a JSON schema (a dict, or its JSON text). Raises ValueError: the text is not JSON."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), disable_any_whitespace)

    @classmethod
    def json_object(cls, disable_any_whitespace: bool = False) -> StructuredOutputs:
        return cls("json_object", None, disable_any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputs:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputs:
        return cls("choice", tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputs:
        return cls("grammar", ebnf)


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
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar; None = free.
        presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logit of every token
            already in the output, once / once per occurrence (OpenAI's definition).
        repetition_penalty: > 0, 1 = off; the logit of every token in the prompt or the output is
            divided by it when positive and multiplied by it when negative (CTRL, Keskar et al.
            2019; vLLM's and transformers' rule).
        logit_bias: token id -> value in [-100, 100] added to its logit (OpenAI's rule).
        min_tokens: no EOS (unless ``ignore_eos``), stop token id or stop string before this many
            output tokens (vLLM's rule).
        bad_words: words never generated: each is tokenized (alone and after a space), and the
            last token of a sequence is forbidden where the output ends with the rest (vLLM's rule).
        allowed_token_ids: only these tokens may be generated; None = any.
        bad_words_token_ids: ``bad_words`` tokenized by the engine (not set by users).
        skip_special_tokens: leave special tokens out of the text (False: tool-call and thinking
            parsers need their markers, which some tokenizers make special tokens).
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
    structured_outputs: StructuredOutputs | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True

    def validate(self, vocab_size: int | None = None) -> None:
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
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"a stop string holds at most {MAX_STOP_STRING_CHARS} characters")
        self._validate_controls(vocab_size)

    def _validate_controls(self, vocab_size: int | None) -> None:
        """The penalties, logit_bias, min_tokens, bad_words and allowed_token_ids (token ids checked
        against ``vocab_size`` when given). Messages start with the field's name."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                             f"{self.repetition_penalty}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} "
                                 f"for token {token_id}")
            _check_token_id("logit_bias", token_id, vocab_size)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if any(not isinstance(word, str) or not word.strip() for word in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for token_id in self.allowed_token_ids:
                _check_token_id("allowed_token_ids", token_id, vocab_size)

    def sampling_options(self, eos_token_ids=frozenset()) -> SamplingOptions:
        """The subset rank 0's sampler needs (``eos_token_ids``: what ``min_tokens`` holds back)."""
        min_stop = [] if not self.min_tokens else sorted(set(self.stop_token_ids) | (
            set() if self.ignore_eos else set(eos_token_ids)))
        return SamplingOptions(
            self.temperature, self.top_p, max(self.top_k, 0), self.min_p, self.seed, self.logprobs,
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
            dict(self.logit_bias) if self.logit_bias else None, self.min_tokens, min_stop,
            [list(ids) for ids in self.bad_words_token_ids or ()] or None,
            list(self.allowed_token_ids) if self.allowed_token_ids is not None else None)


def _check_token_id(name: str, token_id, vocab_size: int | None) -> None:
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (
            vocab_size is not None and token_id >= vocab_size):
        if vocab_size is None:
            raise ValueError(f"{name}: token ids are non-negative integers, got {token_id!r}")
        raise ValueError(f"{name}: token id {token_id!r} is outside the vocabulary [0, {vocab_size})")


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences of ``bad_words``: each word alone and after a space (when that makes other
    tokens of the same count), vLLM's rule (``SamplingParams.update_from_tokenizer``)."""
    sequences: list[list[int]] = []
    for word in words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return [ids for ids in sequences if ids]


@dataclass(slots=True)
class Logprob:
    """Logprob of one emitted token and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Where a finished request's time went in its engine, seconds (vLLM's
    ``vllm:request_{queue,prefill,decode,inference}_time_seconds``, ``vllm/v1/metrics/stats.py``):
    ``queue_s`` from arrival to first scheduled, ``prefill_s`` from then to the first output token
    (prefill chunks and the wait between them), ``decode_s`` from the first to the last token."""

    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def inference_s(self) -> float:
        """First scheduled to last token (vLLM's inference time)."""
        return self.prefill_s + self.decode_s

    @classmethod
    def of(cls, request: Request, now: float) -> RequestTimes:
        """``request``'s times when it ends at ``now`` (``time.monotonic()``); phases it never
        reached take no time."""
        scheduled = request.scheduled_time if request.scheduled_time is not None else now
        first = request.first_token_time if request.first_token_time is not None else now
        return cls(max(scheduled - request.arrival_time, 0.0), max(first - scheduled, 0.0), max(now - first, 0.0))


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
    scheduled_time: float | None = None   # time.monotonic() when first scheduled (queue time ends)
    first_token_time: float | None = None  # ... when its first output token was appended
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0          # leading blocks already registered in the prefix cache
    cache_seed: int = 0                 # first parent hash of its prefix-cache chain (tenant + cache_salt)
    num_cached_tokens: int = 0          # prompt tokens it took from the prefix cache (usage)
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
    # Structured outputs: the matcher of the request's constraint (cluster/engine/grammar.py), advanced
    # by every emitted token; None when unconstrained or once the request has ended.
    grammar: object = None

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

    def sampling_options(self) -> SamplingOptions:
        """What rank 0 samples this request with."""
        return self.params.sampling_options(self.eos_token_ids)

    def may_sample_more(self, max_model_len: int) -> bool:
        """False when the tokens in flight already reach ``max_tokens`` or ``max_model_len``: one
        more step would compute a token the length check is bound to drop; and for a constrained
        request while any token is in flight (async scheduling: it does not run ahead)."""
        if not self.num_placeholders:
            return True
        if self.grammar is not None:   # its next token mask needs the token still being sampled
            return False
        max_tokens = self.params.max_tokens
        return ((max_tokens is None or self.num_output_tokens + self.num_placeholders < max_tokens)
                and self.num_known_tokens < max_model_len)
