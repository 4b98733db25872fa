"""The router while Serve replaces a model replica (rolling upgrade), without Ray: real gRPC servers
stand in for the old replica and its replacement. A request the draining old replica refuses waits
for the replacement instead of failing, and a stream that started on the old replica keeps its
channel when the router learns the new address. Fast (no model)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.replica_pool import ReplicaPool
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc


class FakeReplica(pb_grpc.InferenceServicer):
    """A replica's gRPC API: answers ``text`` in two chunks (the second once ``release`` is set),
    or refuses like a draining coordinator."""

    def __init__(self, text: str, draining: bool = False) -> None:
        self.text, self.draining = text, draining
        self.release = asyncio.Event()
        self.release.set()
        self.served = self.refused = 0

    async def Generate(self, request, context):
        if self.draining:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica unavailable: draining")
        self.served += 1
        half = len(self.text) // 2
        yield pb.GenerateResponse(text=self.text[:half], token_ids=[1], usage=pb.Usage(prompt_tokens=2,
                                                                                        completion_tokens=1))
        await self.release.wait()
        yield pb.GenerateResponse(text=self.text[half:], token_ids=[2], finish_reason="stop",
                                  usage=pb.Usage(prompt_tokens=2, completion_tokens=2))


async def start(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def ready(address: str) -> dict:
    return {"state": "ready", "address": address, "error": None, "info": {"healthy": True, "max_model_len": 64}}


def router(fetch) -> RouterCore:
    # poll_s: long, so only the request path re-polls; token-id prompts need no real tokenizer
    return RouterCore("m", ["m"], [fetch], load_tokenizer=lambda: object(), poll_s=30, route_wait_s=10)


def test_a_request_refused_by_the_draining_replica_waits_for_its_replacement():
    async def scenario():
        old, new = FakeReplica("old!", draining=True), FakeReplica("new!")
        (old_server, old_address), (new_server, new_address) = await start(old), await start(new)

        async def fetch() -> dict:   # Serve's handle reaches the replacement once the old one stops
            return ready(new_address if old.refused else old_address)

        core = router(fetch)
        core.start()
        try:
            await core.wait_started()
            assert core.pool.replicas[0].address == old_address
            response = await core.generate("completion", json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode())
            return response, old.refused, new.served
        finally:
            await core.close()
            await old_server.stop(None)
            await new_server.stop(None)

    response, refused, served = asyncio.run(scenario())
    assert response.status_code == 200, response.body
    assert json.loads(response.body)["choices"][0]["text"] == "new!"
    assert (refused, served) == (1, 1)


def test_a_stream_keeps_its_channel_when_the_replica_moves():
    async def scenario():
        old, new = FakeReplica("abcd"), FakeReplica("efgh")
        old.release.clear()
        (old_server, old_address), (new_server, new_address) = await start(old), await start(new)
        moved = False

        async def fetch() -> dict:
            return ready(new_address if moved else old_address)

        core = router(fetch)
        core.start()
        try:
            await core.wait_started()
            body = json.dumps({"prompt": [1, 2], "max_tokens": 2, "stream": True}).encode()
            events = (await core.generate("completion", body)).body_iterator
            first = await anext(events)
            moved = True
            await core.poll_all()            # the router now routes to the replacement ...
            assert core.pool.replicas[0].address == new_address and len(core.pool._retired) == 1
            old.release.set()                # ... and the running stream still ends on the old one
            rest = [event async for event in events]
            retired_after = len(core.pool._retired)
            again = await core.generate("completion", json.dumps({"prompt": [3], "max_tokens": 2}).encode())
            return first, rest, retired_after, again
        finally:
            await core.close()
            await old_server.stop(None)
            await new_server.stop(None)

    first, rest, retired_after, again = asyncio.run(scenario())
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in [first, *rest] if "[DONE]" not in e]
    assert "".join(texts) == "abcd" and rest[-1] == "data: [DONE]\n\n"
    assert retired_after == 0                               # closed once the stream ended
    assert json.loads(again.body)["choices"][0]["text"] == "efgh"


def test_pool_closes_a_replaced_channel_only_after_its_last_lease():
    closed = []
    pool = ReplicaPool("0", connect=lambda address: (f"channel:{address}", f"stub:{address}"), close=closed.append)
    pool.update("0", ready("a:1"))
    first, second = pool.pick(1, 1), pool.pick(1, 1)
    pool.update("0", ready("b:1"))                            # replaced while two requests run on a:1
    assert closed == [] and (first.stub, pool.replicas[0].stub) == ("stub:a:1", "stub:b:1")
    first.release()
    first.release()                                         # idempotent: the channel is still held
    assert closed == []
    second.release()
    assert closed == ["channel:a:1"]
    pool.update("0", ready("c:1"))                            # nothing leased on b:1: closed at once
    assert closed == ["channel:a:1", "channel:b:1"]


@pytest.mark.parametrize("state", ["loading", "failed"])
def test_no_waiting_when_no_replica_is_being_replaced(state):
    async def scenario():
        async def fetch() -> dict:
            return {"state": state, "address": None, "error": None, "info": None}

        core = router(fetch)
        core.start()
        try:
            await core.wait_started()
            started = asyncio.get_running_loop().time()
            response = await core.generate("completion", b'{"prompt": [1], "max_tokens": 1}')
            return response, asyncio.get_running_loop().time() - started
        finally:
            await core.close()

    response, waited = asyncio.run(scenario())
    assert response.status_code == 503 and waited < 1.0


def test_an_unreachable_replica_is_waited_for_only_a_while():
    pool = ReplicaPool("0")
    pool.update("0", {"state": "ready", "address": None, "info": {"healthy": True}})
    assert not pool.in_transition(30)
    pool.mark_unreachable(pool.replicas[0], "UNAVAILABLE: draining")
    assert pool.in_transition(30) and not pool.in_transition(0)   # gone for longer: 503 at once


class InfoReplica(FakeReplica):
    """A replica that also answers ``ModelInfo`` (healthy until told otherwise)."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.healthy, self.info_calls = True, 0

    async def ModelInfo(self, request, context):
        self.info_calls += 1
        return pb.ModelInfoResponse(healthy=self.healthy, max_model_len=64, num_running=3)


def test_a_ready_replica_is_checked_over_grpc_and_through_serve_only_when_that_says_otherwise():
    """Status calls through Serve cost ~1 ms of replica CPU, ModelInfo over the open channel ~0.15 ms:
    while the replica answers healthy, the periodic check never goes through Serve; once it does not,
    the status call says what the replica is."""
    async def scenario():
        replica = InfoReplica()
        server, address = await start(replica)
        fetched = []

        async def fetch() -> dict:
            fetched.append(1)
            if replica.healthy:
                return ready(address)
            return {"state": "recovering", "address": address, "error": "a rank died", "info": {"healthy": False}}

        core = router(fetch)
        core.start()
        try:
            await core.wait_started()
            before = len(fetched)
            for _ in range(3):
                await core.poll_all()
            checked = (len(fetched) - before, replica.info_calls, core.pool.replicas[0].info["num_running"])
            replica.healthy = False
            await core.poll_all()
            return checked, len(fetched) - before, core.pool.replicas[0].state
        finally:
            await core.close()
            await server.stop(None)

    (through_serve, over_grpc, running), after, state = asyncio.run(scenario())
    assert (through_serve, over_grpc, running) == (0, 3, 3)
    assert (after, state) == (1, "recovering")
