"""``POST /admin/reload_weights`` body checks and its answer when replicas are not ready (no Ray)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from shardserve.cluster.frontend.admin import parse_reload, reload_weights
from shardserve.cluster.frontend.openai_protocol import OpenAIError
from shardserve.cluster.frontend.replica_pool import RECOVERING, ReplicaPool
from shardserve.proto import inference_pb2 as pb


@pytest.mark.parametrize("body,param", [
    (b"[1]", None), (b"{bad", None), (b'{"model": 3}', "model"), (b'{"model": ""}', "model"),
    (b'{"mode": "later"}', "mode"), (b'{"modle": "x"}', "modle")])
def test_bad_bodies_are_400(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_reload(body)
    assert err.value.status == 400 and err.value.param == param


def test_defaults_and_fields():
    assert (parse_reload(b"").model, parse_reload(b"").mode) == ("", "")
    request = parse_reload(b'{"model": "/ckpt", "mode": "abort"}')
    assert (request.model, request.mode) == ("/ckpt", "abort")


def test_every_replica_must_be_ready():
    pool = ReplicaPool(2)
    pool.update(0, {"state": "ready", "address": None, "info": {"healthy": True}})
    pool.update(1, {"state": RECOVERING, "address": None, "error": "shard worker failed", "info": {"healthy": False}})
    response = asyncio.run(reload_weights(pool, b"{}"))
    body = json.loads(response.body)
    assert response.status_code == 503 and "replica 1: recovering: shard worker failed" in body["error"]["message"]




class _Stub:
    """Stands in for one replica's gRPC stub (this is a unit test of the fan-out, not of gRPC)."""

    def __init__(self, log: list, index: int, error: grpc.StatusCode | None = None) -> None:
        self.log, self.index, self.error = log, index, error

    async def ReloadWeights(self, request, metadata=()):
        assert metadata == (("authorization", f"Bearer token-{self.index}"),), "each replica's own internal token"
        self.log.append((self.index, request.model, request.mode))
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="tensor 'w' has shape [2]")
        return pb.ReloadWeightsResponse(changed_tensors=1, unchanged_tensors=9, seconds=0.5, weights_version=2,
                                        aborted_requests=self.index)


def _pool(log: list, errors: dict) -> ReplicaPool:
    pool = ReplicaPool(2)
    for index, replica in enumerate(pool.replicas):
        pool.update(index, {"state": "ready", "address": None, "info": {"healthy": True}, "token": f"token-{index}"})
        replica.stub = _Stub(log, index, errors.get(index))
    return pool


def test_replicas_reload_one_after_another_and_a_refusal_stops_the_rollout():
    log: list = []
    response = asyncio.run(reload_weights(_pool(log, {}), b'{"model": "/new", "mode": "abort"}'))
    body = json.loads(response.body)
    assert response.status_code == 200 and log == [(0, "/new", "abort"), (1, "/new", "abort")]
    assert (body["changed_tensors"], body["weights_version"], body["aborted_requests"]) == (1, 2, 1)
    assert [answer["replica"] for answer in body["replicas"]] == [0, 1]
    log.clear()
    response = asyncio.run(reload_weights(_pool(log, {0: grpc.StatusCode.INVALID_ARGUMENT}), b"{}"))
    body = json.loads(response.body)
    assert response.status_code == 400 and body["error"]["code"] == "invalid_checkpoint" and len(log) == 1
    assert "tensor 'w'" in body["error"]["message"]
    log.clear()   # a replica that refuses to start (lock held, drain timed out): 409, the rollout stops
    response = asyncio.run(reload_weights(_pool(log, {1: grpc.StatusCode.FAILED_PRECONDITION}), b"{}"))
    body = json.loads(response.body)
    assert response.status_code == 409 and body["error"]["code"] == "reload_refused" and len(log) == 2
    assert "replicas reloaded before it: [0]" in body["error"]["message"]
    assert "token-" not in response.body.decode()   # no credential in an error body
