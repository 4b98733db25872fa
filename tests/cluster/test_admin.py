"""``POST /admin/reload_weights`` body checks and its answer when replicas are not ready (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

from shardserve.cluster.admin import parse_reload, reload_weights
from shardserve.cluster.openai_protocol import OpenAIError
from shardserve.cluster.replica_pool import RECOVERING, ReplicaPool


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
