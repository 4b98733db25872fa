"""gRPC front of a coordinator: ``shardserve.v1.Inference`` plus the standard health
(``grpc.health.v1``) and reflection services, on the coordinator's event loop (grpc.aio).

Status codes: INVALID_ARGUMENT for a bad request (before any response is streamed) or a
checkpoint that cannot replace the served one (``ReloadWeights``), UNAUTHENTICATED without a
valid API key (every method but health's, reflection and ``ReloadWeights`` included),
RESOURCE_EXHAUSTED when ``max_queued_requests`` already wait, DEADLINE_EXCEEDED past the client's
deadline or ``request_timeout``, UNAVAILABLE when the replica lost a shard worker (it reports
NOT_SERVING while it repairs itself, SERVING again after), ABORTED for a stream ended by a weight
reload with ``mode="abort"``. A client cancelling ``Generate``, or its deadline passing, aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import math

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.frontend.security import FrontConfig, bearer_matches, warn_if_exposed
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_OPEN_PREFIXES = (f"/{health.SERVICE_NAME}/",)   # health checks need no key; everything else does


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto sampling fields -> :class:`SamplingParams` (unset optionals keep the defaults)."""
    params = SamplingParams(max_tokens=None, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                            ignore_eos=msg.ignore_eos)
    for field in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        if msg.HasField(field):
            setattr(params, field, getattr(msg, field))
    params.validate()
    return params


def _chat(msg: pb.Chat) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in msg.messages]


def _response(out) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text,
        logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
                  for lp in out.new_logprobs],
        finish_reason=out.finish_reason or "",
        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                       spec_decode=_spec_usage(out.spec_decode)))


def _spec_usage(spec) -> pb.SpecDecodeUsage | None:
    """A request's :class:`cluster.engine.request.SpecUsage` as the proto message (None: speculation off)."""
    if spec is None:
        return None
    return pb.SpecDecodeUsage(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                              num_accepted_tokens=spec.num_accepted_tokens,
                              acceptance_length=spec.acceptance_length)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every method but ``grpc.health.v1``'s with UNAUTHENTICATED unless the call's
    metadata holds ``authorization: Bearer KEY`` for one of ``keys``; the handler never runs.
    Services added later are covered too: only the health service is open.

    Args:
        keys: accepted API keys (non-empty).
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self.keys):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""
    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid API key: send metadata 'authorization: Bearer <key>'")

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
    """Maps the proto API onto :class:`cluster.replica.coordinator.Coordinator`."""

    def __init__(self, coordinator, request_timeout: float | None = None) -> None:
        self.coordinator = coordinator
        self.request_timeout = request_timeout

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            return self.coordinator.encode(chat=_chat(request.chat))
        return self.coordinator.encode(text=request.text)

    async def Generate(self, request, context):
        from shardserve.cluster.replica.coordinator import DeadlineExceeded, QueueFull, ReplicaUnavailable, RequestAborted

        try:
            prompt_ids = self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            stream = self.coordinator.generate(prompt_ids, params, request.request_id or None,
                                               deadline=_deadline(context, self.request_timeout))
            async for out in stream:
                yield _response(out)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DeadlineExceeded as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except ReplicaUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica unavailable: {exc}")
        except RequestAborted as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))

    async def Tokenize(self, request, context):
        try:
            if request.WhichOneof("prompt") == "chat":
                ids = self.coordinator.encode(chat=_chat(request.chat))
            else:
                ids = self.coordinator.encode(text=request.text)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        info = self.coordinator.model_info()
        workers = [pb.WorkerProcess(**worker) for worker in info.pop("workers")]
        return pb.ModelInfoResponse(**info, workers=workers)

    async def ReloadWeights(self, request, context):
        from shardserve.cluster.replica.coordinator import ReplicaUnavailable

        try:
            result = await self.coordinator.reload_weights(request.model or None, request.mode or None)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ReplicaUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica unavailable: {exc}")
        return pb.ReloadWeightsResponse(**result)


class GrpcServer:
    """A started grpc.aio server and its health servicer."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.HealthServicer) -> None:
        self.server, self.port, self.health = server, port, health_servicer

    def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for the server and the Inference service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)


async def start_grpc_server(coordinator, host: str, port: int, front: FrontConfig | None = None) -> GrpcServer:
    """Serve ``coordinator`` on ``host:port`` (0 = any free port) under ``front``'s rules (API keys,
    TLS, request timeout); a non-loopback ``host`` without a key logs a warning.

    Raises:
        RuntimeError: the port could not be bound.
    """
    front = front or FrontConfig()
    interceptors = [ApiKeyInterceptor(front.api_keys)] if front.api_keys else []
    # No SO_REUSEPORT: a second server on a port in use must fail, not share the port's connections
    # (the replica being replaced in a rolling upgrade may still hold it while it drains).
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(coordinator, front.request_timeout), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    warn_if_exposed(host, front.api_keys, "the gRPC server")
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
