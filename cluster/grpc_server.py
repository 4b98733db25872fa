"""gRPC front of a coordinator: ``shardserve.v1.Inference`` plus the standard health
(``grpc.health.v1``) and reflection services, on the coordinator's event loop (grpc.aio).

Status codes: INVALID_ARGUMENT for a bad request (before any response is streamed),
UNAVAILABLE when the replica lost a shard worker. A client cancelling ``Generate`` aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardserve.cluster.request import SamplingParams
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name


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
        usage=pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens))


class InferenceServicer(pb_grpc.InferenceServicer):
    """Maps the proto API onto :class:`cluster.coordinator.Coordinator`."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            return self.coordinator.encode(chat=_chat(request.chat))
        return self.coordinator.encode(text=request.text)

    async def Generate(self, request, context):
        from shardserve.cluster.coordinator import ReplicaUnavailable

        try:
            prompt_ids = self._prompt_ids(request)
            params = sampling_from_proto(request.sampling)
            stream = self.coordinator.generate(prompt_ids, params, request.request_id or None)
            async for out in stream:
                yield _response(out)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ReplicaUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica unavailable: {exc}")

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
        return pb.ModelInfoResponse(**self.coordinator.model_info())


class GrpcServer:
    """A started grpc.aio server and its health servicer."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.HealthServicer) -> None:
        self.server, self.port, self.health = server, port, health_servicer

    def set_unhealthy(self) -> None:
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)


async def start_grpc_server(coordinator, host: str, port: int) -> GrpcServer:
    """Serve ``coordinator`` on ``host:port`` (0 = any free port).

    Raises:
        RuntimeError: the port could not be bound.
    """
    # No SO_REUSEPORT: a second server on a port in use must fail, not share the port's connections
    # (the replica being replaced in a rolling upgrade may still hold it while it drains).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(coordinator), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:   # grpcio >= 1.5x raises instead of returning 0
        bound = 0
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server, bound, health_servicer)
