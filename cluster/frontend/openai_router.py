"""The OpenAI front's logic, free of Ray Serve: validate, tokenize once, route, call replicas over
gRPC, and answer as OpenAI does (JSON or SSE).

A generation request is checked (400), matched to the served model (404) and to a ready replica
(503) before anything is sent; the prompt is tokenized here with the same functions the engine
uses (``cluster.tokenizer``: the chat template is rendered once, never a second BOS), and each of
the ``n`` choices per prompt is one gRPC ``Generate`` call with ``seed + j``. The first response
of every call is awaited before answering, so the engine's own rejections (context length, bad
token ids) still become a 400 JSON body, never a broken stream. Text deltas come from the
engine's detokenizer and never split a UTF-8 character; SSE events carry them as they are, or,
for chats with tools or a reasoning parser, as the parsed deltas of
:mod:`cluster.frontend.chat_output` (the non-streamed message is the same chain fed the whole
text). ``/v1/responses`` is a chat underneath (:mod:`cluster.frontend.responses_route`).

Limits come first (:mod:`cluster.frontend.limits`): the caller's request rate (429 with
``Retry-After``), prompts x ``n`` and prompt characters (400), then tokenization on the tokenizer
threads (never on the event loop), token ids checked against the vocabulary, the caller's token
rate; only then is a replica leased. Calls to the replicas carry that replica's internal token
(never a client's key), the caller's tenant (the prefix cache is salted per key) and, with
``request_timeout``, the time left as their gRPC deadline. A replica whose waiting queue is full (RESOURCE_EXHAUSTED) is
skipped for the next one; when all are full the answer is 429 with ``Retry-After``. A deadline
that passes answers 408 (or ends a stream with an error event). Every request is counted once in
``requests_total`` when it ends, with its HTTP status and outcome (``finished``, ``rejected``,
``cancelled``, ``timeout``, ``error``).

Replicas come from Ray Serve (:mod:`cluster.frontend.replica_directory`: the running replicas of
the one ``ModelReplica`` deployment and their routing stats); each is polled for its status
(address, internal token, ModelInfo) and, with prefix-aware routing, followed through its
prefix-cache events. The replica a request goes to is :mod:`cluster.routing`'s choice, over the
prompt's block hashes (salted as the replica salts them: the caller's key digest and
``cache_salt``).

While a replica is being replaced (rolling upgrade) or scaled down it refuses new requests with
UNAVAILABLE; a request refused before anything was sent to the client waits for the replacement
(re-polling the replicas, at most ``route_wait_s``) instead of failing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from starlette.responses import JSONResponse, Response, StreamingResponse

from shardserve.cluster.engine.block_manager import cache_seed
from shardserve.cluster.frontend.chat_output import ChoiceDelta, ChoiceOutput, ParserConfig, delta_body
from shardserve.cluster.frontend.limits import LimitExceeded, RateLimiter, retry_after_header, run_tokenizer
from shardserve.cluster.frontend.metrics import ServeMetrics, replica_info
from shardserve.cluster.frontend.openai_protocol import (
    Choice, OpenAIError, ParsedRequest, TokenText, bad_request, chat_logprobs, chunk_body, completion_logprobs,
    engine_rejected, finish_reason, limit_error, load_body, parse_chat, parse_completion, prompt_chars,
    rate_limited, response_body, timed_out, unavailable, usage_chunk)
from shardserve.cluster.frontend.replica_directory import ReplicaEntry, StaticReplicas
from shardserve.cluster.frontend.replica_link import ReplicaLink
from shardserve.cluster.frontend.replica_pool import (LOADING, READY, RECOVERING, UNREACHABLE, Lease, NoReplicaReady,
                                                      ReplicaPool)
from shardserve.cluster.frontend.responses_api import parse_responses
from shardserve.cluster.frontend.security import ANONYMOUS, Caller, FrontConfig
from shardserve.cluster.routing import RoutingPolicy, prompt_block_hashes
from shardserve.cluster.frontend.structured import structured_to_proto
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
StatusFetcher = Callable[[], Awaitable[dict]]


_RETRY_AFTER_S = 1           # Retry-After of a 429: a queue slot frees when one request ends
_MODEL_NOT_FOUND = "model_not_found"
_NOBODY = Caller(ANONYMOUS, ANONYMOUS)
_MAX_TOKEN_ID = 2**31 - 1     # a proto int32; the vocabulary bounds it further once a replica reported it
_INLINE_HASH_TOKENS = 4096    # longer prompts are hashed on the tokenizer threads, off the event loop
_CACHE_EVENTS_RETRY_S = 1.0   # pause before re-following a replica whose cache-event stream ended


def _connect(address: str, root_certificates: bytes | None = None) -> tuple:
    """A channel to a replica (TLS when ``root_certificates`` is given) and its stub."""
    if root_certificates is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
    return channel, pb_grpc.InferenceStub(channel)


def _close(channel) -> None:
    asyncio.ensure_future(channel.close())


def _wrap_seed(seed: int) -> int:
    return (seed + 2**63) % 2**64 - 2**63  # stay a signed 64-bit proto field


@dataclass(slots=True)
class _Run:
    """A request whose calls are open and whose first responses have arrived."""

    parsed: ParsedRequest
    request_id: str
    created: int
    model: str
    lease: Lease
    calls: list                    # one gRPC call per choice, index = prompt_index * n + j
    choices: list[Choice]
    first_token_at: list           # per choice: monotonic time of its first token, or None
    started: float
    closed: bool = False           # _finish ran
    endpoint: str = "chat"         # requests_total label: chat | completions
    status: int = 499              # HTTP status sent (499: the client left before the answer)
    outcome: str = "cancelled"     # finished | cancelled | timeout | error | dropped (requests_total label)
    caller: Caller = _NOBODY       # who sent it (per-key usage, rate settlement)
    charged_tokens: int = 0        # taken from the caller's token rate at admission
    first_responses: list = None   # each call's first response (grpc.aio.EOF when none), as read


class RouterCore:
    """Everything behind the HTTP routes.

    Args:
        model: the model argument (name, ``.gguf`` file or checkpoint folder).
        served_names: model names requests may ask for (the first is the one reported).
        replicas: where the replicas come from: :class:`cluster.frontend.replica_directory.ServeReplicas`
            (Serve's running replicas), or a list of coroutine functions returning each replica's
            ``status()`` dict (a fixed list, :class:`~cluster.frontend.replica_directory.StaticReplicas`).
        poll_s: status polling period once every replica is ready (faster while loading).
        load_tokenizer: returns the tokenizer; run in a thread by :meth:`start`.
        front: keys (the guard checks them), limits, gRPC TLS (the certificate is trusted when
            dialling a replica) and the request timeout. Replicas are called with the internal
            token each reports in its status.
        route_wait_s: how long a request waits for a replica that is being replaced.
        policy: the routing policy (default: least-loaded).
        parsers: tool-call and reasoning parsers of chat answers (``--tool-call-parser``,
            ``--enable-auto-tool-choice``, ``--reasoning-parser``).
    """

    def __init__(self, model: str, served_names: list[str], replicas, load_tokenizer: Callable[[], object],
                 poll_s: float = 0.5, front: FrontConfig | None = None, route_wait_s: float = 30.0,
                 policy: RoutingPolicy | None = None, parsers: ParserConfig | None = None) -> None:
        self.model_arg, self.served_names = model, list(served_names)
        self.front = front or FrontConfig()
        self.parsers = parsers or ParserConfig()
        tls = self.front.grpc_tls()
        self.replicas = StaticReplicas(replicas) if isinstance(replicas, (list, tuple)) else replicas
        self.pool = ReplicaPool((), functools.partial(_connect, root_certificates=tls and tls[0]), _close, policy)
        self.limits = self.front.limits
        self.rates = RateLimiter(self.limits.rate_limit_requests, self.limits.rate_limit_tokens)
        self.cache_hits_by_key: dict[str, int] = {}   # prompt tokens from the prefix cache, per key (admin only)
        self._reload_lock: asyncio.Lock | None = None
        self.created = int(time.time())   # ``created`` of the model card: when this router started
        self.metrics = ServeMetrics(self.served_names[0])
        self.poll_s, self._load_tokenizer = poll_s, load_tokenizer
        self.route_wait_s = route_wait_s
        self.tokenizer = self.token_text = None
        self.tokenizer_error: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._followers: dict[str, asyncio.Task] = {}   # replica -> task applying its cache events
        self._listed = False             # the replica directory has answered once
        self._polled = asyncio.Event()   # set after the first round of status calls once replicas are listed
        self._links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # replica stub -> ReplicaLink

    # -- background: tokenizer and replica states ------------------------------------------------
    def start(self) -> None:
        """Start loading the tokenizer, following the replica directory and polling the replicas
        (on the running event loop)."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._load())]
        self.replicas.watch(self._on_replicas)
        self._tasks.append(loop.create_task(self._watch()))

    def _on_replicas(self, entries: list[ReplicaEntry]) -> None:
        """Serve's list of running replicas changed (or their routing stats did)."""
        self._listed = True
        added, removed = self.pool.sync(entry.replica_id for entry in entries)
        for entry in entries:
            replica = self.pool.get(entry.replica_id)
            if replica is not None and entry.stats:
                replica.stats = entry.stats
        for key in removed:
            self.metrics.forget_replica(key)
            follower = self._followers.pop(key, None)
            if follower is not None:
                follower.cancel()
        loop = asyncio.get_running_loop()
        for key in added:
            self._tasks.append(loop.create_task(self._poll(key)))
            if self.pool.policy.uses_cache:
                self._followers[key] = loop.create_task(self._follow_cache(key))

    async def _follow_cache(self, key: str) -> None:
        """Keep replica ``key``'s cache digest exact from its prefix-cache events until it leaves."""
        while self.pool.get(key) is not None:
            try:
                async for message in self.replicas.cache_events(key):
                    replica = self.pool.get(key)
                    if replica is None:
                        return
                    replica.digest.apply(message["reset"], message["stored"], message["removed"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - restarting or leaving: follow it again or stop
                logger.debug("cache events of replica %s ended: %s: %s", key, type(exc).__name__, exc)
            await asyncio.sleep(_CACHE_EVENTS_RETRY_S)

    async def _load(self) -> None:
        try:
            self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
            self.token_text = TokenText(self.tokenizer)
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
            logger.exception("router: loading the tokenizer failed")
            self.tokenizer_error = f"{type(exc).__name__}: {exc}"

    async def wait_started(self, timeout_s: float = 60.0) -> None:
        """Wait until the tokenizer is loaded and every replica was polled once (or ``timeout_s``).

        Raises:
            RuntimeError: the tokenizer could not be loaded.
        """
        try:
            await asyncio.wait_for(asyncio.gather(asyncio.shield(self._tasks[0]), self._polled.wait()),
                                   timeout=timeout_s)
        except asyncio.TimeoutError:
            logger.warning("router: not started within %.0f s; serving anyway", timeout_s)
        if self.tokenizer_error:
            raise RuntimeError(f"the router could not load the tokenizer: {self.tokenizer_error}")

    async def _poll(self, key: str) -> None:
        replica = self.pool.get(key)
        if replica is None or (replica.state == READY and await self._still_ready(replica)):
            return
        served = replica.state in (READY, UNREACHABLE)   # when the call went out: a call sent while it
        try:                                              # loaded may time out after it became ready
            status = await asyncio.wait_for(self.replicas.status(key), timeout=10)
        except Exception as exc:  # noqa: BLE001 - loading or restarting replicas answer late or fail
            if replica.state in (READY, UNREACHABLE):   # it served: being replaced or restarted (unless it
                if served:                               # became ready after this call went out)
                    self.pool.mark_unreachable(replica, f"status call failed: {type(exc).__name__}")
                return
            status = {"state": LOADING, "address": replica.address, "error": None}
        try:
            self.pool.update(key, status)
        except Exception:  # noqa: BLE001 - keep watching the other replicas
            logger.exception("router: bad status from replica %s: %r", key, status)

    async def _still_ready(self, replica) -> bool:
        """Ask a ready replica over its gRPC channel whether it still is (``ModelInfo``: healthy, not
        repairing itself, not draining) and refresh its info; False when it is not or does not
        answer, and the status call through Serve then says what it is. NOTE: a status call through Serve costs
        ~3 ms of CPU here and ~2 ms in the replica (Serve's request path on both sides), a gRPC call a
        fraction of that, and the router asks every ``poll_s`` (0.5 s): on few cores that CPU comes
        out of the ranks' step time (``benchmarks/cpu_per_token.py``)."""
        if replica.stub is None:
            return False
        try:
            msg = await replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=2, metadata=replica.metadata)
        except grpc.aio.AioRpcError:
            return False
        if (not msg.healthy or msg.recovering or msg.draining or self.pool.get(replica.key) is not replica
                or replica.state != READY):
            return False
        replica.info = {**replica.info, **{f.name: list(value) if f.is_repeated else value
                                           for f in msg.DESCRIPTOR.fields if f.message_type is None
                                           for value in [getattr(msg, f.name)]}}
        return True

    async def poll_all(self) -> None:
        """Ask every replica for its status now (concurrently) and apply the answers."""
        await asyncio.gather(*(self._poll(replica.key) for replica in list(self.pool.replicas)))
        if self._listed and self.pool.replicas:
            self._polled.set()

    async def _watch(self) -> None:
        while True:
            await self.poll_all()
            ready = self.pool.replicas and len(self.pool.ready()) == len(self.pool.replicas)
            await asyncio.sleep(self.poll_s if ready else 0.25)

    def _link(self, stub, metadata: tuple, local_path: str | None = None) -> ReplicaLink:
        """The streaming link over ``stub``'s channel (over the replica's local socket ``local_path``
        when it is on this machine) with the replica's credential ``metadata`` (one per replica
        channel, opened on first use; a new one if the replica's token or socket changed, the old
        one closed when the requests still on it have ended)."""
        link = self._links.get(stub)
        if link is None or link.metadata != metadata or link.local_path != local_path:
            if link is not None:
                link.retire()
            link = self._links[stub] = ReplicaLink(stub, metadata, local_path)
        return link

    async def close(self) -> None:
        self.replicas.close()
        for task in self._tasks + list(self._followers.values()):
            task.cancel()
        for link in list(self._links.values()):
            link.close()
        channels = self.pool.detach_channels()
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)

    def _ready_or_503(self) -> None:
        if self.tokenizer_error:
            raise unavailable(f"the router could not load the tokenizer: {self.tokenizer_error}")
        if self.tokenizer is None or not self.pool.ready():
            what = "tokenizer loading; " if self.tokenizer is None else ""
            raise unavailable(f"the model is loading or unavailable ({what}{self.pool.summary()})")

    # -- plain endpoints -------------------------------------------------------------------------
    def health_state(self) -> str:
        """``ok`` (the tokenizer is loaded and a replica is ready), ``recovering`` (none ready and
        one repairing itself in place), ``loading`` or ``unhealthy``."""
        if self.tokenizer_error or (self.pool.replicas and all(r.state == "failed" for r in self.pool.replicas)):
            return "unhealthy"
        if self.tokenizer is None or not self.pool.ready():
            return RECOVERING if any(r.state == RECOVERING for r in self.pool.replicas) else "loading"
        return "ok"

    async def health(self) -> Response:
        """``GET /health`` (open): ``{"status": "ok"}`` with 200, or ``loading`` / ``recovering`` /
        ``unhealthy`` with 503. Nothing else: the details are on ``GET /admin/status``.
        It answers from the replica states of the last poll (every ``poll_s``)."""
        state = self.health_state()
        return JSONResponse({"status": state}, status_code=200 if state == "ok" else 503)

    async def admin_status(self) -> Response:
        """``GET /admin/status`` (admin key): the served model, each replica's state, address,
        error and outstanding tokens, and the prefix-cache hits per key and per replica."""
        return JSONResponse({"status": self.health_state(), "model": self.served_names[0],
                             "max_model_len": self.pool.any_info().get("max_model_len"),
                             "tokenizer_error": self.tokenizer_error,
                             "replicas": [dict(r.describe(), prefix_cache_hit_tokens=r.info.get(
                                 "prefix_cache_hit_tokens", 0)) for r in self.pool.replicas],
                             "prefix_cache_hit_tokens_by_key": dict(self.cache_hits_by_key)})

    async def models(self, model_id: str | None = None) -> Response:
        """``GET /v1/models``: the list of the one served model; ``GET /v1/models/{model_id}``: its
        card (404 for another name). 503 while loading."""
        try:
            if model_id is not None and model_id not in self.served_names:
                raise OpenAIError(404, f"The model `{model_id}` does not exist. This server serves "
                                  f"`{self.served_names[0]}`.", "invalid_request_error", "model", _MODEL_NOT_FOUND)
            self._ready_or_503()
        except OpenAIError as err:
            return JSONResponse(err.body(), status_code=err.status)
        card = {"id": self.served_names[0], "object": "model", "created": self.created, "owned_by": "shardserve",
                "root": self.model_arg, "max_model_len": self.pool.any_info().get("max_model_len")}
        return JSONResponse(card if model_id is not None else {"object": "list", "data": [card]})

    async def reload_weights(self, raw_body: bytes) -> Response:
        """``POST /admin/reload_weights`` over every replica, one at a time (see
        :mod:`cluster.frontend.admin`); one rollout at a time (another one gets 409)."""
        from shardserve.cluster.frontend.admin import parse_reload

        try:
            return JSONResponse(await self.reload_all(parse_reload(raw_body)))
        except OpenAIError as err:
            return JSONResponse(err.body(), status_code=err.status)

    async def reload_all(self, request: pb.ReloadWeightsRequest) -> dict:
        """Reload every replica's weights in turn (:func:`cluster.frontend.admin.reload_weights`).

        Raises:
            OpenAIError: 409 while another reload runs on this router, else as ``reload_weights``.
        """
        from shardserve.cluster.frontend.admin import reload_busy, reload_weights

        self._reload_lock = self._reload_lock or asyncio.Lock()
        if self._reload_lock.locked():
            raise reload_busy()
        async with self._reload_lock:
            return await reload_weights(self.pool, request)

    async def metrics_text(self) -> Response:
        """Prometheus exposition; replica gauges refreshed from ModelInfo first (vLLM's names from
        it too, and the prefix-cache counters from the replica's routing stats)."""
        async def refresh(replica) -> None:
            info = None
            if replica.stub is not None:
                try:
                    msg = await replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=2, metadata=replica.metadata)
                    info = replica_info(msg)
                except grpc.aio.AioRpcError:
                    info = None
            self.metrics.set_replica(replica.key, replica.state == "ready", replica.outstanding_tokens, info)
            known, stats = info or replica.info, replica.stats
            self.metrics.vllm.set_replica(
                replica.key, known.get("num_running", stats.get("running", 0)),
                known.get("num_waiting", stats.get("waiting", 0)),
                known.get("num_free_blocks", stats.get("free_blocks", 0)), known.get("num_blocks", stats.get("num_blocks", 0)),
                stats.get("prefix_queries"), stats.get("prefix_hits"))

        await asyncio.gather(*(refresh(r) for r in self.pool.replicas))
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, kind: str, raw_body: bytes, caller: Caller = _NOBODY) -> Response:
        """``POST /v1/chat/completions`` (kind ``chat``), ``/v1/completions`` (``completion``) or
        ``/v1/responses`` (``responses``: a chat underneath, see :mod:`cluster.frontend.responses_api`)
        of ``caller`` (the guard's :class:`Caller`)."""
        started = time.monotonic()
        endpoint = {"chat": "chat", "completion": "completions"}.get(kind, kind)
        timeout = self.front.request_timeout
        charged, echo = 0, None
        try:
            try:
                self.admit(caller)
                body = load_body(raw_body)
                if kind == "responses":
                    parsed, echo = parse_responses(body)
                else:
                    parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
                if parsed.model is not None and parsed.model not in self.served_names:
                    raise OpenAIError(404, f"The model `{parsed.model}` does not exist. This server serves "
                                      f"`{self.served_names[0]}`.", "invalid_request_error", "model", _MODEL_NOT_FOUND)
                if parsed.kind == "chat":
                    self.parsers.check(parsed.chat)
                self._check_limits(parsed.kind, parsed)
                self._ready_or_503()
                prompt_ids, texts = await self._prompt_ids(parsed.kind, parsed)
                charged = self._charge_tokens(caller, parsed, prompt_ids)
            except LimitExceeded as exc:
                raise limit_error(exc) from None
            outputs = [self.parsers.output(parsed.chat, text) if parsed.kind == "chat" else None
                       for text in texts for _ in range(parsed.n)]
            if parsed.structured is not None and outputs and outputs[0] is not None:   # thinking comes first
                parsed.structured = outputs[0].constraint(parsed.structured, self.tokenizer)
            if echo is not None:   # a response always has items, parsed or not
                outputs = [output or ChoiceOutput(None, None) for output in outputs]
            hashes = await self.prompt_hashes(prompt_ids[0], caller, parsed.cache_salt)
            run = await self._start(parsed, prompt_ids, started, started + timeout if timeout else None, caller,
                                    outputs, hashes)
        except OpenAIError as err:
            self.settle(caller, charged, 0)
            self.metrics.count(endpoint, err.status, "timeout" if err.status == 408 else "rejected", caller.key_id)
            headers = {"Retry-After": retry_after_header(err.retry_after)} if err.status == 429 else None
            return JSONResponse(err.body(), status_code=err.status, headers=headers)
        except asyncio.CancelledError:   # the client left before the first token
            self.settle(caller, charged, 0)
            self.metrics.count(endpoint, 499, "cancelled", caller.key_id)
            raise
        run.endpoint, run.charged_tokens = endpoint, charged
        if echo is not None:
            from shardserve.cluster.frontend.responses_route import respond

            return await respond(self, run, echo)
        if parsed.stream:
            run.status = 200
            return _EventStream(self._sse(run), functools.partial(self._finish, run))
        return await self._complete(run)

    # -- limits before work --------------------------------------------------------------------
    def _rate_key(self, caller: Caller) -> str | None:
        """The key whose rates a request counts against (None: exempt, the operator's admin key)."""
        return None if caller.privileged or not self.rates.enabled else caller.key_id

    def admit(self, caller: Caller) -> None:
        """Count a request against the caller's request rate.

        Raises:
            LimitExceeded: 429, the key is over its rate.
        """
        key = self._rate_key(caller)
        if key is not None:
            try:
                self.rates.admit_request(key)
            except LimitExceeded:
                self.metrics.rate_limited.labels(caller.key_id, "requests").inc()
                raise

    def _charge_tokens(self, caller: Caller, parsed: ParsedRequest, prompt_ids: list[list[int]]) -> int:
        return self.charge(caller, parsed.n * sum(len(ids) + (parsed.max_tokens or 0) for ids in prompt_ids))

    def charge(self, caller: Caller, wanted: int) -> int:
        """Take ``wanted`` tokens from the caller's token rate; returns what was charged.

        Raises:
            LimitExceeded: 429, the key is over its token rate.
        """
        key = self._rate_key(caller)
        if key is None or not self.rates.tpm:
            return 0
        try:
            return self.rates.charge_tokens(key, wanted)
        except LimitExceeded:
            self.metrics.rate_limited.labels(caller.key_id, "tokens").inc()
            raise

    def settle(self, caller: Caller, charged: int, used: int) -> None:
        """Give back what a request was charged beyond the ``used`` tokens."""
        key = self._rate_key(caller)
        if key is not None and charged:
            self.rates.settle(key, charged, used)

    def _check_limits(self, kind: str, parsed: ParsedRequest) -> None:
        """Prompts x ``n`` and prompt characters (before anything is tokenized).

        Raises:
            LimitExceeded: 400.
        """
        self.limits.check_choices(len(parsed.prompts), parsed.n)
        self.limits.check_prompt_chars(sum(prompt_chars(prompt) for prompt in parsed.prompts),
                                       "messages" if kind == "chat" else "prompt")

    async def _prompt_ids(self, kind: str, parsed: ParsedRequest) -> tuple[list[list[int]], list[str | None]]:
        """Every prompt's token ids and, for a chat, its rendered text (the reasoning parser reads
        its end): text tokenized on the tokenizer threads, ids checked against the vocabulary
        (before any replica is leased).

        Raises:
            OpenAIError: 400 for a bad prompt.
        """
        param = "messages" if kind == "chat" else "prompt"
        encoded = [await run_tokenizer(self._encode, kind, prompt, parsed.chat) for prompt in parsed.prompts]
        prompt_ids, texts = [ids for ids, _ in encoded], [text for _, text in encoded]
        for ids in prompt_ids:
            self.check_vocabulary(ids, param)
        return prompt_ids, texts

    def check_vocabulary(self, ids: list[int], param: str = "prompt") -> None:
        """Raises OpenAIError (400) for a token id outside the served vocabulary."""
        vocab = self.pool.any_info().get("vocab_size") or _MAX_TOKEN_ID + 1
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param)

    async def prompt_hashes(self, prompt_ids: list[int], caller: Caller, cache_salt: str = "") -> list[int]:
        """The prompt's block hashes as a replica's prefix cache chains them (salted with the
        caller's key digest and ``cache_salt``), when the routing policy reads them and there is a
        choice to make; else none."""
        block_size = self.pool.any_info().get("block_size")
        if not self.pool.policy.uses_cache or not block_size or len(self.pool.ready()) < 2:
            return []
        hash_args = (prompt_ids, block_size, cache_seed(caller.tenant, cache_salt))
        if len(prompt_ids) <= _INLINE_HASH_TOKENS:
            return prompt_block_hashes(*hash_args)
        return await run_tokenizer(prompt_block_hashes, *hash_args)

    def _encode(self, kind: str, prompt, options=None) -> tuple[list[int], str | None]:
        """``(token ids, rendered chat text or None)`` of one prompt (``options``: the chat's tools
        and template arguments)."""
        from shardserve.cluster.tokenizer import encode_prompt, encode_rendered, render_chat

        try:
            if kind == "chat":
                text = render_chat(self.tokenizer, prompt, tools=options and options.tools,
                                   template_kwargs=options and options.template_kwargs)
                return encode_rendered(self.tokenizer, text), text
            return (encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)), None
        except ValueError as exc:
            raise bad_request(str(exc), "messages" if kind == "chat" else "prompt") from exc

    def _grpc_request(self, parsed: ParsedRequest, request_id: str, ids: list[int], index: int,
                      caller: Caller, output=None) -> pb.GenerateRequest:
        """Choice ``index``'s call: its own seed, the caller's tenant and salt, the request as its
        group; special tokens kept when ``output`` (its parser chain) looks for markers."""
        try:
            sampling = pb.SamplingParams(**parsed.sampling)
            if output is not None and output.needs_special_tokens:
                sampling.skip_special_tokens = False   # the parsers' markers may be special tokens
            if parsed.seed is not None:
                sampling.seed = _wrap_seed(parsed.seed + index % parsed.n)
            if parsed.logprobs is not None:
                sampling.logprobs = parsed.logprobs
            if parsed.structured is not None:
                sampling.structured_outputs.CopyFrom(structured_to_proto(parsed.structured))
            return pb.GenerateRequest(request_id=f"{request_id}-{index}", token_ids=pb.TokenIds(ids=ids),
                                      sampling=sampling, tenant=caller.tenant, cache_salt=parsed.cache_salt,
                                      group_id=request_id)
        except (ValueError, TypeError) as exc:   # a value the proto cannot hold
            raise bad_request(f"invalid request: {exc}") from exc

    async def _start(self, parsed: ParsedRequest, prompt_ids: list[list[int]], started: float,
                     deadline: float | None, caller: Caller = _NOBODY, outputs: list | None = None,
                     hashes: list[int] = (), requests: list[pb.GenerateRequest] | None = None) -> _Run:
        """Open every choice's call on the replica the routing policy chooses (``hashes``: the first
        prompt's block hashes, for prefix-aware routing) and read its first response; a replica
        whose queue is full is skipped for the next one. ``requests``: the calls as they are (the
        gRPC endpoint's), instead of one per choice built from ``parsed``.

        A replica that refuses the call (UNAVAILABLE: draining or dead) is skipped; when none is
        left but one is being replaced, the request waits for it (at most ``route_wait_s``).

        Raises:
            OpenAIError: 400 when the engine rejects the request, 408 past ``deadline`` (monotonic
                time), 429 when every ready replica's queue is full, 503 when no replica can take it.
        """
        n, max_len = parsed.n, self.pool.any_info().get("max_model_len") or 2**31
        cost_prompt = n * sum(len(ids) for ids in prompt_ids)
        cost_output = n * sum(parsed.max_tokens or max(1, max_len - len(ids)) for ids in prompt_ids)
        prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
        request_id = requests[0].request_id if requests else f"{prefix}-{uuid.uuid4().hex}"
        excluded: tuple[str, ...] = ()
        full: list[str] = []   # replicas that answered RESOURCE_EXHAUSTED
        wait_until = time.monotonic() + self.route_wait_s
        while True:
            try:
                lease = self.pool.pick(cost_prompt, cost_output, excluded, hashes)
            except NoReplicaReady as exc:
                if full:
                    raise rate_limited(f"the server is at capacity: the waiting queue of every ready replica "
                                       f"({len(full)}) is full; retry after {_RETRY_AFTER_S} s") from exc
                if deadline is not None and time.monotonic() > deadline:
                    raise timed_out(self._timeout_message()) from exc
                if not self.pool.in_transition(self.route_wait_s) or time.monotonic() > wait_until:
                    raise unavailable(f"no replica can take the request: {exc}") from exc
                await asyncio.sleep(0.1)
                await self.poll_all()   # learn the replacement's address (or see the old one back)
                excluded = ()
                continue
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                lease.release()
                raise timed_out(self._timeout_message())
            # the lease keeps the channel (and its credential) even if the replica moves
            link = self._link(lease.stub, lease.metadata, lease.local_path)
            outputs = outputs or [None] * (len(prompt_ids) * n)
            calls: list = []
            try:   # NOTE: every call is built in here: whatever fails, the lease is paid back
                for request in requests or (
                        self._grpc_request(parsed, request_id, ids, p * n + j, caller, outputs[p * n + j])
                        for p, ids in enumerate(prompt_ids) for j in range(n)):
                    calls.append(link.generate(request, timeout))
                firsts = await asyncio.gather(*(call.read() for call in calls), return_exceptions=True)
            except BaseException:  # a bad value, or cancelled: the client left before the first token
                for call in calls:
                    call.cancel()
                lease.release()
                raise
            failure = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failure is None:
                break
            for call in calls:
                call.cancel()
            lease.release()
            if not isinstance(failure, grpc.aio.AioRpcError):
                raise failure
            code = failure.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise engine_rejected(failure.details(), "messages" if parsed.kind == "chat" else "prompt",
                                      parsed.structured_param, parsed.max_tokens_param)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise timed_out(self._timeout_message())
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.metrics.queue_full.labels(lease.replica.key).inc()
                full.append(lease.replica.key)
            else:
                self.pool.mark_unreachable(lease.replica, f"{code.name}: {failure.details()}")
            excluded += (lease.replica.key,)  # try the next replica; 429 or 503 when none is left
        self._count_route(lease, len(prompt_ids[0]))
        self.metrics.in_flight.inc()
        run = _Run(parsed, request_id, int(time.time()), self.served_names[0], lease, calls,
                   [Choice(i, output=outputs[i] if outputs else None) for i in range(len(calls))],
                   [None] * len(calls), started, caller=caller, first_responses=firsts)
        for index, first in enumerate(firsts):
            if first is not grpc.aio.EOF:
                self._absorb(run, index, first)
        return run

    def _count_route(self, lease: Lease, prompt_tokens: int) -> None:
        """Metrics of one routed request: per replica, and the policy's decision."""
        self.metrics.routed.labels(lease.replica.key).inc()
        decision = lease.decision
        if decision is not None:
            self.metrics.decisions.labels(self.pool.policy.name, decision.reason).inc()
            self.metrics.routed_prompt_tokens.inc(prompt_tokens)
            block_size = int(lease.replica.info.get("block_size") or 0)
            self.metrics.expected_hits.inc(min(prompt_tokens, decision.matched_blocks * block_size))

    def _absorb(self, run: _Run, index: int, resp: pb.GenerateResponse) -> None:
        choice = run.choices[index]
        if not choice.prompt_tokens:
            run.lease.prefilled(resp.usage.prompt_tokens)
        if resp.token_ids and run.first_token_at[index] is None:
            run.first_token_at[index] = time.monotonic()
        run.lease.generated(len(resp.token_ids))
        choice.text += resp.text
        choice.token_ids += resp.token_ids
        choice.logprobs += resp.logprobs
        choice.prompt_tokens, choice.completion_tokens = resp.usage.prompt_tokens, resp.usage.completion_tokens
        choice.cached_tokens = resp.usage.cached_tokens
        if resp.usage.HasField("spec_decode"):
            choice.spec_decode = resp.usage.spec_decode
        if resp.HasField("times"):
            choice.times = resp.times
        if resp.finish_reason:
            choice.finish_reason = resp.finish_reason

    def _timeout_message(self) -> str:
        limit = self.front.request_timeout
        return f"the request passed its deadline{f' of {limit:g} s' if limit else ''} and was aborted"

    def _failed(self, run: _Run, exc: grpc.aio.AioRpcError) -> OpenAIError:
        """The error a call's failure after its first response becomes (408 past the deadline, else
        503: ABORTED, a weight reload ended it, leaves the replica ready; anything else marks it
        unreachable until the next poll); sets the run's outcome."""
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            run.status, run.outcome = 408, "timeout"
            return timed_out(self._timeout_message())
        run.status, run.outcome = 503, "error"
        if exc.code() == grpc.StatusCode.ABORTED:
            return unavailable(f"replica {run.lease.replica.key}: {exc.details()}")
        self.pool.mark_unreachable(run.lease.replica, exc.details() or exc.code().name)
        return unavailable(f"replica {run.lease.replica.key} failed mid-request: {exc.details()}")

    def _finish(self, run: _Run) -> None:
        """Cancel what is still open, pay back the lease, record metrics. Idempotent."""
        if run.closed:
            return
        run.closed = True
        self.metrics.count(run.endpoint, run.status, run.outcome, run.caller.key_id)
        for call in run.calls:
            call.cancel()  # no-op for finished calls; aborts (frees blocks) for abandoned ones
        run.lease.release()
        self.metrics.in_flight.dec()
        now = time.monotonic()
        self.metrics.latency.observe(now - run.started)
        counted_prompts, used, cached, prompt = set(), 0, 0, 0
        replica = run.lease.replica.key if self.pool.get(run.lease.replica.key) is not None else None   # still live
        for choice, first in zip(run.choices, run.first_token_at):
            self.metrics.observe_choice(run.started, first, now, choice.completion_tokens)
            self.metrics.count_tokens(run.caller.key_id, 0, choice.completion_tokens)
            if replica is not None:
                self.metrics.vllm.observe_choice(replica, run.started, first, now, choice.completion_tokens)
                if choice.times is not None:
                    self.metrics.vllm.observe_times(replica, choice.times.queue_s, choice.times.prefill_s,
                                                    choice.times.decode_s)
            used += choice.prompt_tokens + choice.completion_tokens
            cached += choice.cached_tokens
            if choice.index // run.parsed.n not in counted_prompts:
                counted_prompts.add(choice.index // run.parsed.n)
                self.metrics.count_tokens(run.caller.key_id, choice.prompt_tokens, 0)
                prompt += choice.prompt_tokens
        if replica is not None:
            self.metrics.vllm.observe_request(replica, now - run.started, prompt,
                                              sum(c.completion_tokens for c in run.choices),
                                              [c.finish_reason for c in run.choices])
        self.settle(run.caller, run.charged_tokens, used)
        key = run.caller.key_id
        self.cache_hits_by_key[key] = self.cache_hits_by_key.get(key, 0) + cached

    async def _read_all(self, run: _Run, index: int, on_response=None) -> None:
        call, choice = run.calls[index], run.choices[index]
        while choice.finish_reason is None:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                return
            self._absorb(run, index, resp)
            if on_response is not None:
                await on_response(index, resp)

    async def _read_run(self, run: _Run) -> JSONResponse | None:
        """Read every choice of a non-streamed run to its end and settle it; the error answer when
        a replica failed (None: all finished)."""
        try:
            await asyncio.gather(*(self._read_all(run, i) for i in range(len(run.calls))))
            run.status, run.outcome = 200, "finished"
        except grpc.aio.AioRpcError as exc:
            err = self._failed(run, exc)
            return JSONResponse(err.body(), status_code=err.status)
        finally:
            self._finish(run)
        return None

    async def _complete(self, run: _Run) -> Response:
        error = await self._read_run(run)
        if error is not None:
            return error
        body = response_body(run.parsed.kind, run.request_id, run.created, run.model, run.choices, self.token_text,
                             run.parsed.logprobs is not None, run.parsed.n)
        return JSONResponse(body)

    def _event(self, run: _Run, index: int, resp: pb.GenerateResponse) -> str | None:
        """The SSE event for one response of choice ``index`` (None when it carries nothing)."""
        reason = finish_reason(resp.finish_reason)
        output, fields = run.choices[index].output, None
        if output is not None:   # parsed chat: reasoning, content and tool-call deltas
            delta = output.feed(resp.text) if resp.text else ChoiceDelta()
            if reason is not None:
                delta.extend(output.finish())
                reason = output.finish_reason(reason)
            fields = delta_body(delta)
            if not fields and not resp.logprobs and reason is None:
                return None
        elif not resp.text and not resp.logprobs and reason is None:
            return None
        logprobs = None
        if run.parsed.logprobs is not None and resp.logprobs:
            if run.parsed.kind == "chat":
                logprobs = chat_logprobs(resp.logprobs, self.token_text)
            else:
                choice = run.choices[index]
                logprobs = completion_logprobs(resp.logprobs, self.token_text, choice.streamed_chars)
                choice.streamed_chars = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        body = chunk_body(run.parsed.kind, run.request_id, run.created, run.model, index, text=resp.text or None,
                          logprobs=logprobs, finish=reason, include_usage=run.parsed.include_usage, fields=fields)
        return _sse_data(body)

    def _drop_slow_client(self, run: _Run) -> None:
        """A streaming client left ``sse_buffer_events`` events unread: abort its request (the
        replicas free its blocks) instead of buffering its output without bound."""
        if not run.closed:
            logger.info("dropping %s: the client left %d events unread", run.request_id, self.limits.sse_buffer_events)
            run.outcome = "dropped"
            self._finish(run)

    async def _sse(self, run: _Run) -> AsyncIterator[str]:
        # Bounded: a client that does not read stops this generator at its ``yield``; once its
        # unread events reach sse_buffer_events the request is dropped (_drop_slow_client).
        queue: asyncio.Queue = asyncio.Queue()
        kind, limit = run.parsed.kind, self.limits.sse_buffer_events

        async def push(index: int, resp) -> None:
            if queue.qsize() >= limit:
                raise _SlowClient
            queue.put_nowait((index, resp))

        async def pump(index: int) -> None:
            try:
                await self._read_all(run, index, push)
            except grpc.aio.AioRpcError as exc:
                queue.put_nowait((index, exc))
            except _SlowClient:
                self._drop_slow_client(run)
            finally:
                queue.put_nowait((index, None))

        # The first events are made before the pumps start (they change the choices), and the pumps
        # start before anything is yielded: a client that reads nothing still fills the bounded queue.
        opening = []
        for index, choice in enumerate(run.choices):
            if kind == "chat":
                opening.append(_sse_data(chunk_body(kind, run.request_id, run.created, run.model, index, text="",
                                                    role=True, include_usage=run.parsed.include_usage)))
            first = pb.GenerateResponse(text=choice.text, token_ids=choice.token_ids, logprobs=choice.logprobs,
                                        finish_reason=choice.finish_reason or "")
            opening.append(self._event(run, index, first))
        tasks = [asyncio.create_task(pump(i)) for i in range(len(run.calls))]
        try:
            for event in opening:
                if event:
                    yield event
            open_calls = len(tasks)
            while open_calls:
                # Every event already waiting goes out in one write: a stream that fell behind catches up
                # in one message through Serve instead of one per token; nothing is held back.
                events, failed = [], None
                index, item = await queue.get()
                if run.outcome == "dropped":
                    return
                while True:
                    if item is None:
                        open_calls -= 1
                    elif isinstance(item, grpc.aio.AioRpcError):
                        failed = item
                        break
                    else:
                        events.append(self._event(run, index, item) or "")
                    if queue.empty():
                        break
                    index, item = queue.get_nowait()
                if failed is not None:
                    err = self._failed(run, failed)
                    run.status = 200   # the stream had started: the error is its last event
                    yield "".join(events) + _sse_data(err.body())
                    break
                if any(events):
                    yield "".join(events)
            else:
                if run.parsed.include_usage:
                    prompt = sum({c.index // run.parsed.n: c.prompt_tokens for c in run.choices}.values())
                    yield _sse_data(usage_chunk(kind, run.request_id, run.created, run.model, prompt,
                                                sum(c.completion_tokens for c in run.choices), run.choices))
                run.outcome = "finished"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self._finish(run)


class _SlowClient(Exception):
    """A streaming client's unread events reached the limit."""


class _EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even when the client leaves before
    the event generator has started (its own ``finally`` would then never run)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse_data(body: dict) -> str:
    # ensure_ascii=False: characters travel whole, as UTF-8, exactly as the engine emitted them
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
