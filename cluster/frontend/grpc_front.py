"""The one gRPC endpoint: ``shardserve.v1.Inference`` served by the router on ``--grpc-port``.

External gRPC clients dial one address whatever the replicas do (scale, upgrade, move); the
router's listener has the same API-key interceptor, health (``grpc.health.v1``: SERVING while a
replica is ready and the tokenizer is loaded) and reflection as a replica's server
(:func:`cluster.replica.grpc_server.serve_inference`), and routes like the HTTP routes do
(:class:`cluster.frontend.openai_router.RouterCore`): the caller's rate, prompt characters before
tokenizing, tokenization on the router's tokenizer threads, token ids checked against the
vocabulary, then the routing policy (prefix-aware over the prompt's salted block hashes) picks the
replica, which is called with its internal token and the caller's tenant. Responses are relayed
as the replica sends them; a replica that refuses before the first response (draining, queue
full) is skipped for another, as for HTTP.

Status codes are the replica's (relayed with its details) or, for what the router decides
itself: INVALID_ARGUMENT (bad prompt, ids outside the vocabulary), RESOURCE_EXHAUSTED (rate,
every queue full, message size), DEADLINE_EXCEEDED (client deadline or ``request_timeout``),
UNAVAILABLE (no replica ready), UNAUTHENTICATED / PERMISSION_DENIED / UNIMPLEMENTED (keys and
roles, before the handler runs). ``ModelInfo`` answers for one ready replica (prefix-cache
counters only for the admin key); ``ReloadWeights`` (admin key) reloads every replica in turn.

Each replica still serves gRPC on its own address (``--replica-grpc-port``) for direct access
(debugging, a client pinned to one replica): same API, same keys, no routing.

The listener sets SO_REUSEPORT: during a rolling upgrade of the router its replacement binds the
same port while the old one drains.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import grpc

from shardserve.cluster.frontend.limits import LimitExceeded, run_tokenizer
from shardserve.cluster.frontend.openai_protocol import OpenAIError, ParsedRequest
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.security import ANONYMOUS, Caller, FrontConfig
from shardserve.cluster.replica.grpc_chat import chat_chars, chat_prompt
from shardserve.cluster.replica.grpc_server import SERVICE, GrpcServer, request_authorization, serve_inference
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
HEALTH_PERIOD_S = 0.5
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 409: grpc.StatusCode.FAILED_PRECONDITION,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status of an HTTP status the router decided (anything else: UNAVAILABLE)."""
    return _CODES.get(status, grpc.StatusCode.UNAVAILABLE)


class RouterServicer(pb_grpc.InferenceServicer):
    """``shardserve.v1.Inference`` over the router's replicas.

    Args:
        core: the router (replicas, policy, tokenizer, limits, metrics).
        front: keys and limits (the same as the HTTP routes').
    """

    def __init__(self, core: RouterCore, front: FrontConfig) -> None:
        self.core, self.front = core, front

    def _caller(self, context) -> Caller:
        return self.front.identify(request_authorization(context.invocation_metadata())) or Caller(ANONYMOUS, ANONYMOUS)

    def _deadline(self, context) -> float | None:
        """Monotonic time by which the call must end (client deadline or ``request_timeout``)."""
        limits = [self.front.request_timeout] if self.front.request_timeout else []
        remaining = context.time_remaining()
        if remaining is not None and math.isfinite(remaining) and remaining < 1e8:
            limits.append(max(0.0, remaining))
        return time.monotonic() + min(limits) if limits else None

    async def _prompt_ids(self, request) -> list[int]:
        """The request's token ids (text and chats tokenized here, after the character limit). A
        chat is rendered here only to route and charge it: the replica renders it again, with the
        request's output parsing.

        Raises:
            LimitExceeded, ValueError: a bad prompt.
        """
        core, kind = self.core, request.WhichOneof("prompt")
        core._ready_or_503()
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
        elif kind == "chat":
            core.limits.check_prompt_chars(chat_chars(request.chat), "chat")
            ids, _ = await run_tokenizer(chat_prompt, core.tokenizer, request.chat, None, None)
        else:
            if not request.text:
                raise ValueError("prompt must not be empty")
            core.limits.check_prompt_chars(len(request.text), "text")
            ids, _ = await run_tokenizer(core._encode, "completion", request.text)
        core.check_vocabulary(ids)
        return ids

    async def Generate(self, request, context):
        core, caller, started = self.core, self._caller(context), time.monotonic()
        charged, run = 0, None
        try:
            core.admit(caller)
            ids = await self._prompt_ids(request)
            max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
            charged = core.charge(caller, len(ids) + (max_tokens or 0))
            call = pb.GenerateRequest()
            call.CopyFrom(request)
            if request.WhichOneof("prompt") != "chat":   # a chat goes as it is (the replica parses its answer)
                call.token_ids.ids[:] = ids
            # the replica sees an id of the router's own: two clients (or one, twice) may send the same id
            call.request_id = f"grpc-{uuid.uuid4().hex}"
            call.tenant, call.group_id = caller.tenant, call.request_id
            parsed = ParsedRequest("completion", None, [ids], max_tokens=max_tokens, cache_salt=request.cache_salt)
            hashes = await core.prompt_hashes(ids, caller, request.cache_salt)
            run = await core._start(parsed, [ids], started, self._deadline(context), caller, hashes=hashes,
                                    requests=[call])
        except (ValueError, OpenAIError) as exc:   # LimitExceeded and OpenAIError carry their status
            status = getattr(exc, "status", 400)   # a plain ValueError: a bad prompt
            core.settle(caller, charged, 0)
            core.metrics.count("grpc", status, "timeout" if status == 408 else "rejected", caller.key_id)
            await context.abort(grpc_code(status), str(exc))
        except asyncio.CancelledError:   # the deadline passed or the client left before the first token
            core.settle(caller, charged, 0)
            remaining = context.time_remaining()
            past_deadline = remaining is not None and remaining <= 0.01
            core.metrics.count("grpc", 408 if past_deadline else 499, "timeout" if past_deadline else "cancelled",
                               caller.key_id)
            raise
        run.endpoint, run.charged_tokens, run.status = "grpc", charged, 200
        client_id, failure = request.request_id or call.request_id, None
        try:
            first = run.first_responses[0]
            if first is grpc.aio.EOF:
                run.outcome = "finished"
                return
            first.request_id = client_id
            yield first
            call, choice = run.calls[0], run.choices[0]
            while choice.finish_reason is None:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                core._absorb(run, 0, resp)
                resp.request_id = client_id
                yield resp
            run.outcome = "finished"
        except grpc.aio.AioRpcError as exc:
            core._failed(run, exc)
            failure = exc
        finally:
            core._finish(run)
        if failure is not None:
            await context.abort(failure.code(), failure.details() or failure.code().name)

    async def Tokenize(self, request, context):
        caller = self._caller(context)
        try:
            self.core.admit(caller)
            if request.WhichOneof("prompt") == "chat":
                self.core.limits.check_prompt_chars(chat_chars(request.chat), "chat")
                self.core._ready_or_503()
                ids, _ = await run_tokenizer(chat_prompt, self.core.tokenizer, request.chat, None, None)
            else:
                self.core.limits.check_prompt_chars(len(request.text), "text")
                if not request.text:
                    raise ValueError("prompt must not be empty")
                ids, _ = await run_tokenizer(self.core._encode, "completion", request.text)
        except LimitExceeded as exc:
            await context.abort(grpc_code(exc.status), str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OpenAIError as err:
            await context.abort(grpc_code(err.status), err.message)
        return pb.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        ready = self.core.pool.ready()
        if not ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no replica is ready ({self.core.pool.summary()})")
        replica = min(ready, key=lambda r: r.outstanding_tokens)
        try:
            info = await replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=10, metadata=replica.metadata)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or exc.code().name)
        if not self._caller(context).privileged:   # a cache counter is a side channel between tenants
            info.prefix_cache_hit_tokens = 0
        return info

    async def ReloadWeights(self, request, context):
        try:
            answer = await self.core.reload_all(request)
        except OpenAIError as err:
            await context.abort(grpc_code(err.status), err.message)
        return pb.ReloadWeightsResponse(**{k: v for k, v in answer.items() if k != "replicas"})


class RouterGrpc:
    """The started endpoint and the task that keeps its health status current."""

    def __init__(self, server: GrpcServer, core: RouterCore, host: str) -> None:
        self.server, self.core = server, core
        self.address = f"{host}:{server.port}"
        self._task = asyncio.get_running_loop().create_task(self._follow_health())

    async def _follow_health(self) -> None:
        serving = None
        while True:
            now = self.core.health_state() == "ok"
            if now != serving:
                self.server.set_serving(now)
                serving = now
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def stop(self, grace_s: float = 1.0) -> None:
        self._task.cancel()
        await self.server.stop(grace_s)


async def start_router_grpc(core: RouterCore, host: str, port: int, front: FrontConfig) -> RouterGrpc:
    """Serve ``core`` on ``host:port`` (0: any free port) as the app's one gRPC endpoint.

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = await serve_inference(RouterServicer(core, front), host, port, front, reuse_port=True)
    server.set_serving(core.health_state() == "ok")
    logger.info("router: gRPC endpoint (%s) on %s:%d", SERVICE, host, server.port)
    return RouterGrpc(server, core, host)
