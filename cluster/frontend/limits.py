"""Limits checked before any work: request size, prompt characters, choices per request, per-key
rates, and the gRPC server's own limits. Every refusal happens before a token is computed and is
an OpenAI-style 4xx (gRPC INVALID_ARGUMENT / RESOURCE_EXHAUSTED) at the caller.

- Body size (``max_request_body_bytes``, default 8 MiB): larger HTTP bodies get 413 before they
  are read (``Content-Length``) or as soon as the bytes read pass the limit (chunked bodies);
  gRPC messages over it are refused by grpcio (RESOURCE_EXHAUSTED).
- Prompt characters (``max_prompt_chars``, default 2,000,000 per request, all prompts and
  messages together): 400 before tokenizing. Tokenizing itself runs on a small thread pool of
  low CPU priority (:func:`tokenizer_pool`), never on an event loop.
- Choices (``max_choices``, default 64): prompts x ``n`` of one request.
- Rates (``rate_limit_requests`` / ``rate_limit_tokens`` per minute and key, default off):
  token buckets (:class:`RateLimiter`); a request over them gets 429 with ``Retry-After``.
  Tokens are charged when a request is admitted (prompt + ``max_tokens``) and settled to what
  it really used when it ends.
- SSE: a stream keeps at most ``sse_buffer_events`` events for a client that does not read; past
  that the client is dropped and its request aborted (its KV blocks freed).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_PROMPT_CHARS = 2_000_000
DEFAULT_MAX_CHOICES = 64
DEFAULT_SSE_BUFFER_EVENTS = 256
DEFAULT_GRPC_MAX_CONCURRENT_RPCS = 4096
TOKENIZER_THREADS = 2          # concurrent tokenizations per process (each may take seconds on 2 MB)
TOKENIZER_NICE = 10            # Linux nice of those threads: decoding steps keep the CPU first


class LimitExceeded(ValueError):
    """A request over a limit. ``status``: the HTTP status it maps to (400, 413 or 429);
    ``retry_after``: seconds (429 only); ``param``: the request field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after


@dataclass(slots=True)
class Limits:
    """Work limits every front (router and replicas) applies.

    Attributes:
        max_request_body_bytes: HTTP body / gRPC message size at most, bytes.
        max_prompt_chars: characters of all prompts and messages of one request at most.
        max_choices: prompts x ``n`` of one request at most.
        rate_limit_requests: requests per minute per key (None: no limit).
        rate_limit_tokens: prompt + output tokens per minute per key (None: no limit).
        sse_buffer_events: events a streaming client may leave unread before it is dropped.
        grpc_max_concurrent_rpcs: calls one gRPC server runs at once; more get RESOURCE_EXHAUSTED.
    """

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_choices: int = DEFAULT_MAX_CHOICES
    rate_limit_requests: int | None = None
    rate_limit_tokens: int | None = None
    sse_buffer_events: int = DEFAULT_SSE_BUFFER_EVENTS
    grpc_max_concurrent_rpcs: int = DEFAULT_GRPC_MAX_CONCURRENT_RPCS

    def validate(self) -> None:
        """Raises ValueError naming the flag of the first value that is not positive."""
        for name in ("max_request_body_bytes", "max_prompt_chars", "max_choices", "sse_buffer_events",
                     "grpc_max_concurrent_rpcs", "rate_limit_requests", "rate_limit_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                flag = "--rate-limit" if name.startswith("rate_limit") else "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Raises LimitExceeded (400) when a request's prompts hold more than ``max_prompt_chars``."""
        if num_chars > self.max_prompt_chars:
            raise LimitExceeded(f"the prompt holds {num_chars} characters; this server takes at most "
                                f"{self.max_prompt_chars} per request (--max-prompt-chars)", 400, param)

    def check_choices(self, num_prompts: int, n: int) -> None:
        """Raises LimitExceeded (400) when prompts x ``n`` is over ``max_choices``."""
        if num_prompts * n > self.max_choices:
            raise LimitExceeded(f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices; this server "
                                f"takes at most {self.max_choices} per request (--max-choices)", 400,
                                "n" if n > 1 else "prompt")

    def check_body_size(self, num_bytes: int) -> None:
        """Raises LimitExceeded (413) for a body over ``max_request_body_bytes``."""
        if num_bytes > self.max_request_body_bytes:
            raise LimitExceeded(f"the request body has more than {self.max_request_body_bytes} bytes "
                                "(--max-request-body-bytes)", 413)


def parse_rate_limit(text: str) -> tuple[int, int | None]:
    """``--rate-limit REQUESTS[,TOKENS]`` (per minute and key) -> ``(requests, tokens or None)``.

    Raises:
        ValueError: not one or two positive integers.
    """
    parts = [part.strip() for part in text.split(",")]
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 2 or any(number < 1 for number in numbers):
        raise ValueError(f"--rate-limit takes REQUESTS[,TOKENS] per minute, positive integers; got {text!r}")
    return numbers[0], numbers[1] if len(numbers) == 2 else None


class _Bucket:
    """A token bucket of ``capacity`` refilled at ``capacity`` per minute; it may go negative (a
    request that used more than it was charged leaves a debt that later requests wait out)."""

    __slots__ = ("capacity", "level", "updated")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity, self.level, self.updated = float(capacity), float(capacity), now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` (at most the capacity) is available; 0 when it is now."""
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.capacity


class RateLimiter:
    """Per-key request and token budgets per minute (token buckets, as OpenAI's RPM / TPM).

    Args:
        requests_per_minute: requests a key may start per minute (None: no limit).
        tokens_per_minute: prompt + output tokens a key may use per minute (None: no limit).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm, self.tpm, self.clock = requests_per_minute, tokens_per_minute, clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def _bucket(self, table: dict, capacity: int, key: str, now: float) -> _Bucket:
        bucket = table.get(key)
        if bucket is None:
            bucket = table[key] = _Bucket(capacity, now)
        bucket.refill(now)
        return bucket

    def admit_request(self, key: str) -> None:
        """Count one request of ``key`` (call before any work).

        Raises:
            LimitExceeded: 429 with ``retry_after`` when the key's requests per minute are used up,
                or its token budget is already spent (a debt).
        """
        with self._lock:
            now = self.clock()
            tokens = self._bucket(self._tokens, self.tpm, key, now) if self.tpm else None
            if tokens is not None and tokens.level <= 0:
                raise _over("tokens", self.tpm, tokens.wait_for(1))
            if self.rpm:
                requests = self._bucket(self._requests, self.rpm, key, now)
                wait = requests.wait_for(1)
                if wait > 0:
                    raise _over("requests", self.rpm, wait)
                requests.level -= 1

    def charge_tokens(self, key: str, tokens: int) -> int:
        """Take ``tokens`` (prompt + the output asked for) from ``key``'s budget; returns what was
        charged (settle it with :meth:`settle` when the request ends).

        Raises:
            LimitExceeded: 429 with ``retry_after`` when fewer tokens are left (a request larger
                than the whole budget waits for a full bucket).
        """
        if not self.tpm:
            return 0
        with self._lock:
            bucket = self._bucket(self._tokens, self.tpm, key, self.clock())
            wait = bucket.wait_for(tokens)
            if wait > 0:
                raise _over("tokens", self.tpm, wait)
            bucket.level -= tokens
            return tokens

    def settle(self, key: str, charged: int, used: int) -> None:
        """A request that was charged ``charged`` tokens used ``used``: give back or take the difference."""
        if not self.tpm:
            return
        with self._lock:
            bucket = self._bucket(self._tokens, self.tpm, key, self.clock())
            bucket.level = min(bucket.capacity, bucket.level + charged - used)


def _over(what: str, per_minute: int, wait_s: float) -> LimitExceeded:
    return LimitExceeded(f"rate limit reached: this key may use {per_minute} {what} per minute "
                         f"(--rate-limit); retry after {max(1, round(wait_s + 0.5))} s", 429, None, wait_s)


def retry_after_header(wait_s: float | None) -> str:
    """``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, int(wait_s + 0.999))) if wait_s else "1"


_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _lower_priority() -> None:
    """Run this (tokenizer) thread at a lower CPU priority than the engine's (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
    except (AttributeError, OSError):   # not Linux, or not permitted: plain priority
        pass


def tokenizer_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's tokenizer threads (``TOKENIZER_THREADS`` at nice ``TOKENIZER_NICE``): the HF
    tokenizers release the GIL while they encode, so an event loop stays free meanwhile."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize",
                                                          initializer=_lower_priority)
        return _pool


async def run_tokenizer(fn: Callable, *args):
    """``fn(*args)`` on :func:`tokenizer_pool` (await it from an event loop)."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(tokenizer_pool(), fn, *args)
