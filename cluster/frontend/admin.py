"""Operator endpoints of the OpenAI front: ``POST /admin/reload_weights`` and ``GET /admin/status``.

Only the admin key reaches them (:class:`cluster.frontend.openai_app.FrontGuard`: 404 when no admin
key is configured, 403 for an inference key). The reload body is ``{"model": PATH, "mode": "drain"
| "abort"}`` (both optional: the served files, changed on disk, and ``drain``; ``PATH`` must lie
under the replicas' ``--allowed-model-root``). The router asks every replica in turn over gRPC
``ReloadWeights`` (one at a time, so the other replicas keep serving; one rollout at a time) and
answers the first replica's counts with the total wall time; a checkpoint the first replica
refuses is a 400 naming the first bad tensor, and no replica changed anything; a reload a replica
refuses (another reload holds the cluster's lock, or its drain timed out) is a 409. The calls to
the replicas carry each replica's internal token.
"""

from __future__ import annotations

import json
import time

import grpc
from starlette.responses import JSONResponse, Response

from shardserve.cluster.frontend.openai_protocol import OpenAIError, bad_request, unavailable
from shardserve.cluster.frontend.replica_pool import READY, ReplicaPool
from shardserve.cluster.replica.weight_swap import RELOAD_MODES
from shardserve.proto import inference_pb2 as pb

_FIELDS = ("changed_tensors", "unchanged_tensors", "seconds", "weights_version", "aborted_requests")


def parse_reload(raw_body: bytes) -> pb.ReloadWeightsRequest:
    """The gRPC request for a ``/admin/reload_weights`` body.

    Raises:
        OpenAIError: 400 for a body that is not a JSON object with optional string ``model`` and
            ``mode`` in ``drain`` / ``abort``.
    """
    try:
        body = json.loads(raw_body) if raw_body.strip() else {}
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - {"model", "mode"})
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; expected 'model' and 'mode'", unknown[0])
    model, mode = body.get("model"), body.get("mode")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty path (or absent: the served files)", "model")
    if mode is not None and mode not in RELOAD_MODES:
        raise bad_request(f"'mode' must be one of {list(RELOAD_MODES)}, got {mode!r}", "mode")
    return pb.ReloadWeightsRequest(model=model or "", mode=mode or "")


def reload_busy() -> Response:
    """409: a rollout is already running on this router."""
    return JSONResponse(OpenAIError(409, "a weight reload is already in progress; retry when it is done",
                                    "invalid_request_error", None, "reload_in_progress").body(), status_code=409)


async def reload_weights(pool: ReplicaPool, raw_body: bytes) -> Response:
    """``POST /admin/reload_weights``: 200 with ``changed_tensors``, ``unchanged_tensors``,
    ``seconds``, ``weights_version``, ``aborted_requests`` and ``replicas`` (one answer each);
    400 for a bad body or a checkpoint that cannot replace the served one (outside the allowed
    model root included); 409 when a replica refuses to start (lock held, drain timed out); 503
    when a replica is not ready or fails."""
    started = time.monotonic()
    try:
        request = parse_reload(raw_body)
        not_ready = [r for r in pool.replicas if r.state != READY or r.stub is None]
        if not_ready:
            raise unavailable(f"every replica must be ready to reload weights ({pool.summary()})")
        answers = []
        for replica in pool.replicas:
            try:
                answer = await replica.stub.ReloadWeights(request, metadata=replica.metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise bad_request(exc.details(), "model", "invalid_checkpoint") from exc
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise OpenAIError(409, f"replica {replica.index}: {exc.details()} (replicas reloaded before "
                                      f"it: {[a['replica'] for a in answers]})", "invalid_request_error", None,
                                      "reload_refused") from exc
                raise unavailable(f"replica {replica.index} failed to reload ({exc.code().name}: {exc.details()}); "
                                  f"replicas reloaded before it: {[a['replica'] for a in answers]}") from exc
            answers.append({"replica": replica.index, **{name: getattr(answer, name) for name in _FIELDS}})
    except OpenAIError as err:
        return JSONResponse(err.body(), status_code=err.status)
    first = answers[0]
    return JSONResponse({**{name: first[name] for name in _FIELDS},
                         "seconds": round(time.monotonic() - started, 3),
                         "aborted_requests": sum(a["aborted_requests"] for a in answers), "replicas": answers})
