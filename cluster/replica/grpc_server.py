"""gRPC front of a coordinator: ``shardserve.v1.Inference`` plus the standard health
(``grpc.health.v1``) and reflection services, on the coordinator's event loop (grpc.aio).

Status codes: INVALID_ARGUMENT for a bad request (before any response is streamed; prompts over
``max_prompt_chars`` before they are tokenized) or a checkpoint that cannot replace the served one
(``ReloadWeights``), UNAUTHENTICATED without a valid API key (every method but health's,
reflection included), UNIMPLEMENTED / PERMISSION_DENIED for admin methods without an admin key
configured / called with an inference key (:class:`AccessInterceptor`), FAILED_PRECONDITION for a
reload refused (another one holds the cluster's lock, or the drain timed out),
RESOURCE_EXHAUSTED when ``max_queued_requests`` requests already wait, a key is over its rate,
or a message is over ``max_request_body_bytes``, DEADLINE_EXCEEDED past the client's
deadline or ``request_timeout``, UNAVAILABLE when the replica lost a shard worker (it reports
NOT_SERVING while it repairs itself, SERVING again after), ABORTED for a stream ended by a weight
reload with ``mode="abort"``. A client cancelling ``Generate``, or its deadline passing, aborts the
request and frees its KV blocks.

``GenerateStream`` (the router's link, :class:`StreamLink`) carries many requests in one call under
the same rules per request (the call's caller, every field of ``GenerateRequest``, deadlines); a
request's error is a ``StreamError`` with the status ``Generate`` would have ended with.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardserve.cluster.engine.block_manager import cache_seed
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.frontend.limits import LimitExceeded, Limits, RateLimiter
from shardserve.cluster.frontend.security import ANONYMOUS, Caller, FrontConfig
from shardserve.cluster.frontend.structured import structured_from_proto
from shardserve.cluster.replica.grpc_chat import chat_chars, chat_prompt, parsed_response
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)   # health checks need no key; everything else does
GRPC_MAX_STREAMS_PER_CONNECTION = 1024
GRPC_MAX_METADATA_BYTES = 16 * 1024


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto sampling fields -> :class:`SamplingParams` (unset optionals keep the defaults)."""
    params = SamplingParams(max_tokens=None, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                            ignore_eos=msg.ignore_eos)
    for field in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_tokens", "skip_special_tokens"):
        if msg.HasField(field):
            setattr(params, field, getattr(msg, field))
    if msg.HasField("structured_outputs"):
        params.structured_outputs = structured_from_proto(msg.structured_outputs)
    if msg.logit_bias:
        params.logit_bias = dict(msg.logit_bias)
    params.bad_words = list(msg.bad_words)
    if msg.allowed_token_ids:
        params.allowed_token_ids = list(msg.allowed_token_ids)
    params.validate()
    return params


def _response(out) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
        logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                  for lp in out.new_logprobs],
        finish_reason=out.finish_reason or "",
        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                       cached_tokens=out.num_cached_tokens,
                       spec_decode=_spec_usage(out.spec_decode)),
        times=pb.RequestTimes(queue_s=out.times.queue_s, prefill_s=out.times.prefill_s, decode_s=out.times.decode_s)
        if out.times is not None else None)


def _spec_usage(spec) -> pb.SpecDecodeUsage | None:
    """A request's :class:`cluster.engine.request.SpecUsage` as the proto message (None: speculation off)."""
    if spec is None:
        return None
    return pb.SpecDecodeUsage(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                              num_accepted_tokens=spec.num_accepted_tokens,
                              acceptance_length=spec.acceptance_length)


ADMIN_METHODS = frozenset({f"/{SERVICE}/ReloadWeights"})   # admin key (or the router's token) only


def request_authorization(metadata) -> str | None:
    """The `authorization` value of a call's metadata (None when absent)."""
    return dict(metadata or ()).get("authorization")


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Roles on every method but ``grpc.health.v1``'s (services added later are covered too):

    - admin methods (:data:`ADMIN_METHODS`): UNIMPLEMENTED when no admin key is configured,
      UNAUTHENTICATED without a valid key, PERMISSION_DENIED for an inference key; the admin key and
      the router's internal token pass.
    - every other method: UNAUTHENTICATED without a valid key when keys are configured.

    The handler never runs for a refused call.

    Args:
        front: the keys (digests) and the replica's internal token digest.
    """

    def __init__(self, front: FrontConfig) -> None:
        self.front = front

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        caller = self.front.identify(request_authorization(handler_call_details.invocation_metadata))
        if method in ADMIN_METHODS:
            if not self.front.admin_enabled:
                return _refusal(handler, grpc.StatusCode.UNIMPLEMENTED, "the admin API is off on this server "
                                "(start it with an admin key: --admin-api-key-file)")
            if caller is None or caller.role == ANONYMOUS:
                return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "this method needs the admin key: "
                                "send metadata 'authorization: Bearer <admin key>'")
            if not caller.privileged:
                return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, "this method needs the admin key, "
                                "not an inference key")
            return handler
        if caller is None:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid API key: send metadata 'authorization: Bearer <key>'")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``."""
    async def refuse(_request, context):
        await context.abort(code, message)

    kinds = ((handler.unary_unary, grpc.unary_unary_rpc_method_handler),
             (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
             (handler.stream_unary, grpc.stream_unary_rpc_method_handler))
    make = next((make for behaviour, make in kinds if behaviour is not None), grpc.stream_stream_rpc_method_handler)
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _deadline(context, request_timeout: float | None) -> float | None:
    """Event-loop time by which the call must end: the client's deadline or ``request_timeout``
    from now, whichever comes first (None: no limit)."""
    limits = [request_timeout] if request_timeout else []
    remaining = context.time_remaining()
    if remaining is not None and math.isfinite(remaining) and remaining < 1e8:   # no deadline: huge
        limits.append(max(0.0, remaining))
    return asyncio.get_running_loop().time() + min(limits) if limits else None


class InferenceServicer(pb_grpc.InferenceServicer):
    """Maps the proto API onto :class:`cluster.replica.coordinator.Coordinator`, with the caller's
    limits: prompt characters before tokenizing (off the event loop), per-key rates for direct
    callers (the router's calls were counted at the router), the caller's tenant as the prefix-cache
    salt, and the prefix-cache counter for privileged callers only.

    Args:
        coordinator: the replica.
        front: keys, limits and the request timeout.
    """

    def __init__(self, coordinator, front: FrontConfig) -> None:
        self.coordinator, self.front = coordinator, front
        self.limits = front.limits
        self.rates = RateLimiter(front.limits.rate_limit_requests, front.limits.rate_limit_tokens)

    def _caller(self, context) -> Caller:
        """Who calls (the interceptor already refused unknown keys)."""
        return self.front.identify(request_authorization(context.invocation_metadata())) or Caller(ANONYMOUS, ANONYMOUS)

    async def _prompt(self, request, params: SamplingParams) -> tuple[list[int], object]:
        """Prompt ids, and the output chain when the request asks for parsing (else None); chats
        are checked, rendered and tokenized on the tokenizer threads."""
        kind = request.WhichOneof("prompt")
        parsing = request.parsing if request.HasField("parsing") else None
        if kind == "chat":
            self.limits.check_prompt_chars(chat_chars(request.chat), "chat")
            return await self.coordinator.on_tokenizer(chat_prompt, self.coordinator.tokenizer, request.chat,
                                                       parsing, params)
        if parsing is not None:
            raise ValueError("parsing: needs a chat prompt (its template and tools tell how to read the answer)")
        if kind == "token_ids":
            return list(request.token_ids.ids), None
        self.limits.check_prompt_chars(len(request.text), "text")
        return await self.coordinator.encode_async(text=request.text), None

    async def _stream(self, request, caller: Caller, deadline: float | None):
        """The responses to one ``GenerateRequest`` of ``caller`` (``Generate`` and
        ``GenerateStream`` alike): the caller's request and token rates (direct callers only: the
        router's calls were counted at the router), prompt limits, the tenant's prefix-cache salt and
        the request group (the router's only), the deadline (event-loop time), then the engine; the
        output parsed (tool calls, reasoning) when the request asks for it.

        Raises:
            Exception: a request's error, mapped to its status by :func:`_status_of`.
        """
        charged, used = 0, 0
        try:
            if not caller.privileged:
                self.rates.admit_request(caller.key_id)
            params = sampling_from_proto(request.sampling)
            prompt_ids, output = await self._prompt(request, params)
            if not caller.privileged:
                charged = self.rates.charge_tokens(caller.key_id, len(prompt_ids) + (params.max_tokens or 0))
            tenant = request.tenant if caller.privileged else caller.tenant
            group = request.group_id if caller.privileged and request.group_id else None
            stream = self.coordinator.generate(prompt_ids, params, request.request_id or None, deadline=deadline,
                                               cache_seed=cache_seed(tenant, request.cache_salt), group=group)
            async for out in stream:
                used = out.num_prompt_tokens + out.num_output_tokens
                yield _response(out) if output is None else parsed_response(_response(out), output)
        finally:
            if charged:
                self.rates.settle(caller.key_id, charged, used)

    async def Generate(self, request, context):
        try:
            async for resp in self._stream(request, self._caller(context),
                                           _deadline(context, self.front.request_timeout)):
                yield resp
        except Exception as exc:  # noqa: BLE001 - mapped to its status, or re-raised (UNKNOWN)
            status = _status_of(exc)
            if status is None:
                raise
            await context.abort(*status)

    async def GenerateStream(self, request_iterator, context):
        """Many requests over one call (:class:`StreamLink`), each under ``Generate``'s rules for the
        call's caller; one response per engine step."""
        link = StreamLink(self, self._caller(context))
        reader = asyncio.create_task(link.read(request_iterator))
        try:
            while (batch := await link.next_batch()) is not None:
                yield batch
        finally:
            reader.cancel()
            link.close()

    async def Tokenize(self, request, context):
        from shardserve.cluster.replica.coordinator import QueueFull

        caller = self._caller(context)
        try:
            if not caller.privileged:
                self.rates.admit_request(caller.key_id)
            if request.WhichOneof("prompt") == "chat":
                self.limits.check_prompt_chars(chat_chars(request.chat), "chat")
                ids, _ = await self.coordinator.on_tokenizer(chat_prompt, self.coordinator.tokenizer, request.chat,
                                                             None, None)
            else:
                self.limits.check_prompt_chars(len(request.text), "text")
                ids = await self.coordinator.encode_async(text=request.text)
        except LimitExceeded as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.status in (413, 429) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        info = self.coordinator.model_info()
        if not self._caller(context).privileged:   # a cache counter is a side channel between tenants
            info["prefix_cache_hit_tokens"] = 0
        workers = [pb.WorkerProcess(**worker) for worker in info.pop("workers")]
        return pb.ModelInfoResponse(**info, workers=workers)

    async def ReloadWeights(self, request, context):
        from shardserve.cluster.replica.coordinator import ReplicaUnavailable
        from shardserve.cluster.replica.reload_guard import ReloadRefused

        try:
            result = await self.coordinator.reload_weights(request.model or None, request.mode or None)
        except ReloadRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ReplicaUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica unavailable: {exc}")
        return pb.ReloadWeightsResponse(**result)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a Generate call ends with for ``exc`` (None: not a request's error)."""
    from shardserve.cluster.replica.coordinator import DeadlineExceeded, QueueFull, ReplicaUnavailable, RequestAborted

    if isinstance(exc, LimitExceeded):   # a ValueError: 400 is INVALID_ARGUMENT, 413 / 429 are not
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.status in (413, 429) else grpc.StatusCode.INVALID_ARGUMENT
        return code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, ReplicaUnavailable):
        return grpc.StatusCode.UNAVAILABLE, f"replica unavailable: {exc}"
    if isinstance(exc, RequestAborted):
        return grpc.StatusCode.ABORTED, str(exc)
    return None


class StreamLink:
    """The coordinator's side of one ``GenerateStream`` call.

    Each started request runs as a task that appends its responses to one outbox; the call's
    writer sends the outbox whenever it is not empty. The engine loop hands a step's outputs to
    every request at once, and their tasks all run before the writer wakes, so a step that
    produced tokens for many requests of this call is one message (vLLM's batched engine-core
    outputs); a single stream is never held back.
    """

    def __init__(self, servicer: InferenceServicer, caller: Caller) -> None:
        self.servicer, self.caller = servicer, caller
        self.tasks: dict[str, asyncio.Task] = {}
        self.responses: list[pb.GenerateResponse] = []
        self.errors: list[pb.StreamError] = []
        self.ready = asyncio.Event()
        self.half_closed = False   # the client sends nothing more: the call ends once its requests have

    async def read(self, request_iterator) -> None:
        """Start and cancel requests as the client sends them; note when it has sent its last."""
        async for msg in request_iterator:
            if msg.WhichOneof("kind") == "generate":
                rid = msg.generate.request_id
                if not rid or rid in self.tasks:
                    self._fail(rid, grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is empty or in use")
                    continue
                if len(self.tasks) >= GRPC_MAX_STREAMS_PER_CONNECTION:   # as many as Generate calls on a connection
                    self._fail(rid, grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {GRPC_MAX_STREAMS_PER_CONNECTION} "
                               "requests open on this GenerateStream call")
                    continue
                deadline = asyncio.get_running_loop().time() + msg.timeout_s if msg.timeout_s > 0 else None
                limit = self.servicer.front.request_timeout
                if limit:
                    deadline = min(deadline or math.inf, asyncio.get_running_loop().time() + limit)
                self.tasks[rid] = asyncio.create_task(self._run(msg.generate, deadline))
            elif msg.WhichOneof("kind") == "cancel":
                task = self.tasks.pop(msg.cancel, None)
                if task is not None:
                    task.cancel()   # leaving the coordinator's stream aborts the request, frees its blocks
        self.half_closed = True
        self.ready.set()

    async def _run(self, request: pb.GenerateRequest, deadline: float | None) -> None:
        rid = request.request_id
        try:
            async for resp in self.servicer._stream(request, self.caller, deadline):
                self.responses.append(resp)
                self.ready.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends this request only
            status = _status_of(exc) or (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            self._fail(rid, *status)
        finally:
            self.tasks.pop(rid, None)
            self.ready.set()   # the writer checks whether the call is over

    def _fail(self, request_id: str, code: grpc.StatusCode, details: str) -> None:
        self.errors.append(pb.StreamError(request_id=request_id, code=code.value[0], details=details))
        self.ready.set()

    async def next_batch(self) -> pb.StreamResponse | None:
        """Everything produced since the last batch (waits until there is something); None once the
        client has half-closed the call and every request on it has ended and been sent (the call
        then ends OK)."""
        while not (self.responses or self.errors):
            if self.half_closed and not self.tasks:
                return None
            await self.ready.wait()
            self.ready.clear()
        batch = pb.StreamResponse(responses=self.responses, errors=self.errors)
        self.responses, self.errors = [], []
        return batch

    def close(self) -> None:
        """The call ended (the router went away): abort every request still running on it."""
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()


class GrpcServer:
    """A started grpc.aio server and its health servicer; a replica's also serves ``GenerateStream``
    to routers on this machine over a Unix socket (:attr:`local`, ``cluster/replica/local_link.py``)."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.HealthServicer) -> None:
        self.server, self.port, self.health = server, port, health_servicer
        self.local = None   # LocalLinkServer of a replica's server

    @property
    def local_address(self) -> str | None:
        """The local link's socket path (None: no local link)."""
        return self.local.path if self.local is not None else None

    def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for the server and the Inference service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.local is not None:
            await self.local.stop()
        await self.server.stop(grace_s)


def server_options(limits: Limits, reuse_port: bool = False) -> list[tuple[str, int]]:
    """grpcio server options: message size, concurrent streams per connection, keepalive and ping
    abuse limits, header size. No SO_REUSEPORT unless ``reuse_port``: a replica's second server on
    a port in use must fail, not share the port's connections (the replica being replaced in a
    rolling upgrade may still hold it while it drains); the router's one endpoint shares its port
    with the router it replaces (both route to the same replicas)."""
    return [("grpc.so_reuseport", int(reuse_port)),
            ("grpc.max_receive_message_length", limits.max_request_body_bytes),
            ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_metadata_size", GRPC_MAX_METADATA_BYTES),
            ("grpc.keepalive_time_ms", 60_000),                  # ping idle clients every minute
            ("grpc.keepalive_timeout_ms", 20_000),               # and drop those that do not answer
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 2),                  # ping floods end the connection
            ("grpc.max_connection_idle_ms", 30 * 60_000)]


async def start_grpc_server(coordinator, host: str, port: int, front: FrontConfig | None = None) -> GrpcServer:
    """Serve ``coordinator`` on ``host:port`` (0 = any free port) under ``front``'s rules (roles,
    limits, TLS, request timeout), and its ``GenerateStream`` on a local socket too. The caller
    refuses a non-loopback ``host`` without a key (:func:`cluster.frontend.security.refuse_exposed`)
    before the model loads.

    Raises:
        RuntimeError: the port could not be bound.
    """
    from shardserve.cluster.replica.local_link import LocalLinkServer

    front = front or FrontConfig()
    servicer = InferenceServicer(coordinator, front)
    server = await serve_inference(servicer, host, port, front)
    local = LocalLinkServer(servicer)
    try:
        await local.start()
        server.local = local
    except OSError as exc:   # e.g. a $TMPDIR too long for a socket path (108 bytes): routers keep gRPC
        logger.warning("no local link for routers on this machine (%s); they use gRPC", exc)
        await local.stop()
    return server


async def serve_inference(servicer: pb_grpc.InferenceServicer, host: str, port: int, front: FrontConfig,
                          reuse_port: bool = False) -> GrpcServer:
    """A started gRPC server of ``shardserve.v1.Inference`` (``servicer``: a replica's or the
    router's), health and reflection, behind :class:`AccessInterceptor` and ``front``'s limits and
    TLS; health says SERVING.

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.aio.server(interceptors=[AccessInterceptor(front)], options=server_options(front.limits, reuse_port),
                             maximum_concurrent_rpcs=front.limits.grpc_max_concurrent_rpcs)
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    tls = front.grpc_tls()
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            cert_chain, private_key = tls
            credentials = grpc.ssl_server_credentials([(private_key, cert_chain)])
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:   # grpcio >= 1.5x raises instead of returning 0
        bound = 0
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server, bound, health_servicer)
