"""The router's streaming link to a replica (``GenerateStream``), without Ray or a model: the real
gRPC servicer of a coordinator over a stand-in engine that hands every request one token per
step, all at once, as the engine loop does; over gRPC and over the local socket a router on the
replica's machine uses (``cluster/replica/local_link.py``). Fast."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from shardserve.cluster.engine.block_manager import cache_seed
from shardserve.cluster.engine.engine import RequestOutput
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.replica_link import ReplicaLink
from shardserve.cluster.frontend.security import FrontConfig, key_digest
from shardserve.cluster.replica.coordinator import DeadlineExceeded, QueueFull
from shardserve.cluster.replica.grpc_server import start_grpc_server
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc


class StepEngine:
    """Stands in for a coordinator: ``step()`` gives every running request its next token at once."""

    def __init__(self, tokens_per_request: int = 3, queue_limit: int = 100) -> None:
        self.tokens, self.queue_limit = tokens_per_request, queue_limit
        self.queues: dict[str, asyncio.Queue] = {}
        self.aborted: list[str] = []
        self.seen: dict[str, tuple] = {}   # request id -> (SamplingParams, cache_seed, group) as received
        self.local_address = None          # the server's local link socket (set by run())

    def encode(self, text=None, chat=None) -> list[int]:
        return [1, 2]

    async def encode_async(self, text=None, chat=None) -> list[int]:
        return self.encode(text, chat)

    def step(self) -> None:
        for queue in self.queues.values():
            queue.put_nowait(None)

    async def generate(self, prompt_ids, params, request_id=None, deadline=None, cache_seed=0, group=None):
        self.seen[request_id] = (repr(params), cache_seed, group)
        if len(self.queues) >= self.queue_limit:
            raise QueueFull("full")
        if params.max_tokens == 99:
            raise ValueError("max_tokens 99 is refused")
        queue = self.queues[request_id] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            for i in range(1, self.tokens + 1):
                timeout = None if deadline is None else deadline - loop.time()
                try:
                    await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    raise DeadlineExceeded("the request passed its deadline and was aborted") from None
                done = i == self.tokens
                yield RequestOutput(request_id, [10 + i], f"t{i} ", [], done, "length" if done else None,
                                    len(prompt_ids), i)
        finally:
            self.queues.pop(request_id)
            if i < self.tokens:
                self.aborted.append(request_id)


def request(rid: str, max_tokens: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=[1, 2]),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0))


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def run(scenario, front: FrontConfig | None = None):
    async def main():
        engine = StepEngine()
        server = await start_grpc_server(engine, "127.0.0.1", 0, front)
        engine.local_address = server.local_address
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            return await scenario(engine, pb_grpc.InferenceStub(channel), server.port)
        finally:
            await channel.close()
            await server.stop(None)

    return asyncio.run(main())


TRANSPORTS = pytest.mark.parametrize("local", [False, True], ids=["grpc", "local"])


@TRANSPORTS
def test_a_step_for_many_requests_is_one_message_and_each_stream_is_whole(local):
    async def scenario(engine, stub, port):
        link = ReplicaLink(stub, (), engine.local_address if local else None)
        calls = [link.generate(request(f"r{i}")) for i in range(8)]
        await until(lambda: len(engine.queues) == 8)
        texts = {call.request_id: "" for call in calls}
        for _ in range(3):
            engine.step()
            for call in calls:
                texts[call.request_id] += (await call.read()).text
        ends = [await call.read() for call in calls]
        return texts, ends, link.num_batches

    texts, ends, batches = run(scenario)
    assert set(texts.values()) == {"t1 t2 t3 "}
    assert all(end is grpc.aio.EOF for end in ends)
    assert batches == 3, f"3 steps of 8 requests arrive as 3 messages, not {batches}"


@TRANSPORTS
def test_cancel_aborts_on_the_replica_and_errors_keep_their_status(local):
    async def scenario(engine, stub, port):
        link = ReplicaLink(stub, (), engine.local_address if local else None)
        left = link.generate(request("left"))
        refused = link.generate(request("bad", max_tokens=99))
        late = link.generate(request("late"), timeout=0.2)
        await until(lambda: {"left", "late"} <= set(engine.queues))
        engine.step()
        first = await left.read()
        left.cancel()
        await until(lambda: "left" in engine.aborted)
        errors = []
        for call in (refused, late):
            try:
                await call.read()
                await call.read()
            except grpc.aio.AioRpcError as exc:
                errors.append(exc.code())
        await until(lambda: "late" not in engine.queues)
        return first.text, errors

    first, errors = run(scenario)
    assert first == "t1 "
    assert errors == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED]


def test_a_half_closed_stream_ends_ok_once_its_requests_have():
    """A client that sends its requests and half-closes gets every answer, then the call's OK end;
    with nothing open it ends at once (as a bidirectional call of grpc's own examples does)."""
    async def scenario(engine, stub, port):
        async def two():
            for rid in ("a", "b"):
                yield pb.StreamRequest(generate=request(rid))

        async def none():
            return
            yield

        call = stub.GenerateStream(two())
        await until(lambda: {"a", "b"} <= set(engine.queues))
        for _ in range(3):
            engine.step()
        texts = {}
        async for batch in call:
            for resp in batch.responses:
                texts[resp.request_id] = texts.get(resp.request_id, "") + resp.text
        empty = [batch async for batch in stub.GenerateStream(none())]
        return texts, await call.code(), empty

    texts, code, empty = run(scenario)
    assert texts == {"a": "t1 t2 t3 ", "b": "t1 t2 t3 "}
    assert code == grpc.StatusCode.OK and empty == []


def test_a_request_fails_when_the_replica_goes_away():
    async def scenario(engine, stub, port):
        link = ReplicaLink(stub)
        call = link.generate(request("r"))
        await until(lambda: "r" in engine.queues)
        channel = grpc.aio.insecure_channel("127.0.0.1:1")   # nothing listens there
        dead_stub = pb_grpc.InferenceStub(channel)   # the router's lease keeps its stub alive the same way
        dead = ReplicaLink(dead_stub)
        try:
            await dead.generate(request("x")).read()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        finally:
            await channel.close()
        call.cancel()
        return code

    assert run(scenario) == grpc.StatusCode.UNAVAILABLE


@TRANSPORTS
def test_every_request_field_and_the_callers_role_cross_the_link_as_over_generate(local):
    """Sampling controls, structured outputs, cache salt, tenant and group reach the engine the same
    over the link as over Generate, for the router's token (tenant and group kept) and for a client
    key (its own tenant; the request's tenant and group ignored); no key: UNAUTHENTICATED."""
    sampling = pb.SamplingParams(
        max_tokens=3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=7, logprobs=2, stop=["!"],
        stop_token_ids=[9], presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
        logit_bias={5: 1.5}, min_tokens=1, bad_words=["zz"], allowed_token_ids=[1, 2, 5],
        structured_outputs=pb.StructuredOutputs(regex="[ab]+"))
    front = FrontConfig.from_keys(["client-key"], internal_digest=key_digest("router-token"))

    def rich(rid: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=[1, 2]), sampling=sampling,
                                  cache_salt="salt", tenant="tenant-a", group_id="group-1")

    async def scenario(engine, stub, port):
        for who, key in (("router", "router-token"), ("client", "client-key")):
            metadata = (("authorization", f"Bearer {key}"),)
            call = stub.Generate(rich(f"{who}-unary"), metadata=metadata)
            link = ReplicaLink(stub, metadata, engine.local_address if local else None)
            linked = link.generate(rich(f"{who}-link"))
            await until(lambda: {f"{who}-unary", f"{who}-link"} <= set(engine.queues))
            for _ in range(3):
                engine.step()
            assert [r.text async for r in call] == ["t1 ", "t2 ", "t3 "]
            assert [(await linked.read()).text for _ in range(3)] == ["t1 ", "t2 ", "t3 "]
            link.close()
        anonymous = ReplicaLink(stub, (), engine.local_address if local else None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anonymous.generate(rich("nobody")).read()
        return engine.seen, refused.value.code()

    seen, refused = run(scenario, front)
    for who in ("router", "client"):
        assert seen[f"{who}-link"] == seen[f"{who}-unary"], who
    params, seed, group = seen["router-link"]
    for value in ("logit_bias={5: 1.5}", "bad_words=['zz']", "allowed_token_ids=[1, 2, 5]", "[ab]+",
                  "repetition_penalty=1.1", "min_tokens=1", "logprobs=2"):
        assert value in params, value
    assert (seed, group) == (cache_seed("tenant-a", "salt"), "group-1")
    assert seen["client-link"][1] not in (0, seed) and seen["client-link"][2] is None
    # the local link closes a refused caller's connection (UNAVAILABLE): it is the router's alone
    assert "nobody" not in seen and refused == (grpc.StatusCode.UNAVAILABLE if local else
                                                grpc.StatusCode.UNAUTHENTICATED)


@TRANSPORTS
@pytest.mark.parametrize("stream", [False, True])
def test_router_answers_over_the_link_and_queue_full_is_429(stream, local):
    async def scenario(engine, stub, port):
        async def fetch() -> dict:
            return {"state": "ready", "address": f"127.0.0.1:{port}", "error": None,
                    "info": {"healthy": True, "max_model_len": 64},
                    "local_address": engine.local_address if local else "/nonexistent/link.sock"}

        core = RouterCore("m", ["m"], [fetch], load_tokenizer=lambda: object(), poll_s=30)
        core.start()
        try:
            await core.wait_started()

            async def steps():
                while True:
                    engine.step()
                    await asyncio.sleep(0.01)

            stepper = asyncio.create_task(steps())
            body = json.dumps({"prompt": [1, 2], "max_tokens": 3, "stream": stream}).encode()
            answers = await asyncio.gather(*(core.generate("completion", body) for _ in range(4)))
            texts = []
            for answer in answers:
                if stream:
                    events = [e async for e in answer.body_iterator]
                    texts.append("".join(json.loads(line[6:])["choices"][0]["text"]
                                         for e in events for line in e.split("\n\n") if line.startswith("data: {")))
                else:
                    texts.append(json.loads(answer.body)["choices"][0]["text"])
            engine.queue_limit = 0
            full = await core.generate("completion", body)
            stepper.cancel()
            return texts, full.status_code, [link.local_path for link in core._links.values()]
        finally:
            await core.close()

    texts, status, paths = run(scenario)
    assert texts == ["t1 t2 t3 "] * 4
    assert status == 429
    assert paths and all((path is not None) == local for path in paths)   # a socket not on this machine: gRPC


def test_closing_the_local_link_aborts_its_requests_and_a_bad_frame_closes_it():
    """The router going away (its connection closed) aborts every request it started on the
    replica, as cancelling the gRPC call does; a frame over the size limit ends the connection
    without reaching the engine; a dead socket answers UNAVAILABLE."""
    async def scenario(engine, stub, port):
        from shardserve.workers.step_channel import HEADER, frame

        link = ReplicaLink(stub, (), engine.local_address)
        calls = [link.generate(request(rid)) for rid in ("a", "b")]
        await until(lambda: {"a", "b"} <= set(engine.queues))
        engine.step()
        first = [(await call.read()).text for call in calls]
        link.close()
        await until(lambda: {"a", "b"} <= set(engine.aborted))
        reader, writer = await asyncio.open_unix_connection(engine.local_address)
        writer.write(frame(b"Bearer whatever") + HEADER.pack(1 << 31))
        closed = await asyncio.wait_for(reader.read(), 5)   # b"": the replica closed the connection
        writer.close()
        with pytest.raises(grpc.aio.AioRpcError) as dead:
            await ReplicaLink(stub, (), "/nonexistent/link.sock").generate(request("x")).read()
        return first, closed, dead.value.code(), len(engine.queues)

    first, closed, dead, open_requests = run(scenario)
    assert first == ["t1 ", "t1 "] and closed == b"" and open_requests == 0
    assert dead == grpc.StatusCode.UNAVAILABLE


def test_the_local_socket_is_private_and_removed_at_stop():
    async def main():
        import os
        import stat

        server = await start_grpc_server(StepEngine(), "127.0.0.1", 0)
        path = server.local_address
        mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        await server.stop(None)
        return mode, os.path.exists(os.path.dirname(path))

    mode, left = asyncio.run(main())
    assert mode == 0o700 and not left


def test_stopping_the_replica_ends_the_local_link_and_its_requests():
    """A replica stopping (shutdown, the end of a drain) closes the router's connection: the router's
    requests end UNAVAILABLE and are aborted on the replica, and stop() does not wait on the router."""
    async def main():
        engine = StepEngine()
        server = await start_grpc_server(engine, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        link = ReplicaLink(pb_grpc.InferenceStub(channel), (), server.local_address)
        call = link.generate(request("r"))
        await until(lambda: "r" in engine.queues)
        await asyncio.wait_for(server.stop(None), 5)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(call.read(), 5)
            await until(lambda: "r" in engine.aborted)
            return ended.value.code()
        finally:
            await channel.close()

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE


def test_a_socket_path_too_long_leaves_the_replica_on_grpc(tmp_path, monkeypatch):
    """A Unix socket path holds at most 108 bytes: under a deep temporary folder the replica starts
    without a local link (routers keep gRPC) instead of failing to start."""
    import tempfile

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))

    async def main():
        server = await start_grpc_server(StepEngine(), "127.0.0.1", 0)
        address = server.local_address
        await server.stop(None)
        return address, list(deep.iterdir())

    assert asyncio.run(main()) == (None, [])


def test_the_local_link_closes_silent_or_garbled_connections_and_sweeps_dead_replicas_sockets(tmp_path, monkeypatch):
    """A connection that never says who it is is closed after the auth timeout; a frame that is not
    a protobuf closes its connection without a stray task error; a link directory a killed replica
    left (nothing listening, older than a minute) is removed by the next replica, a live one is not."""
    import os
    import socket
    import tempfile

    import gc

    from shardserve.cluster.replica import local_link

    monkeypatch.setattr(local_link, "_AUTH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / "shardserve-link-dead"
    dead.mkdir()
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(dead / "link.sock"))
    left.close()                            # a socket file nobody listens on: its replica was killed
    os.utime(dead, (0, 0))

    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        engine = StepEngine()
        server = await start_grpc_server(engine, "127.0.0.1", 0)
        live = os.path.dirname(server.local_address)
        os.utime(live, (0, 0))              # old, but listening: kept
        kept = local_link.remove_stale_links()
        silent_reader, silent = await asyncio.open_unix_connection(server.local_address)
        closed = await asyncio.wait_for(silent_reader.read(), 5)
        reader, writer = await asyncio.open_unix_connection(server.local_address)
        writer.write(local_link.frame(b"Bearer x") + local_link.frame(b"\xff\xff not a protobuf"))
        garbled = await asyncio.wait_for(reader.read(), 5)
        for w in (silent, writer):
            w.close()
        await server.stop(None)
        gc.collect()                        # a task that ended with an error nobody read says so now
        return closed, garbled, kept, os.path.exists(live), errors, len(engine.queues)

    closed, garbled, kept, live_left, errors, open_requests = asyncio.run(main())
    assert closed == b"" and garbled == b"" and open_requests == 0
    assert not dead.exists() and kept == [] and not live_left   # the dead one went at start, the live one at stop
    assert errors == [], errors


@TRANSPORTS
def test_a_request_started_right_after_close_opens_a_new_stream(local):
    """``close()`` then ``generate()`` in the same tick: the request is served over a new stream,
    not put on the cancelled one (it hung there until its deadline)."""
    async def scenario(engine, stub, port):
        link = ReplicaLink(stub, (), engine.local_address if local else None)
        first = link.generate(request("first"))
        await until(lambda: "first" in engine.queues)
        link.close()
        again = link.generate(request("again"))
        await until(lambda: "again" in engine.queues)
        texts = ""
        for _ in range(3):
            engine.step()
            texts += (await again.read()).text
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await first.read()
        return texts, await again.read(), closed.value.code()

    texts, end, closed = run(scenario)
    assert texts == "t1 t2 t3 " and end is grpc.aio.EOF and closed == grpc.StatusCode.UNAVAILABLE


@TRANSPORTS
def test_a_replaced_link_finishes_its_requests_then_closes(local):
    """The router's link to a replica is replaced when the replica's token (or socket) changes:
    requests on the old stream finish there, then the old stream is closed (it stayed open)."""
    async def scenario(engine, stub, port):
        core = RouterCore.__new__(RouterCore)
        core._links = {}
        path = engine.local_address if local else None
        old = core._link(stub, (("authorization", "Bearer a"),), path)
        running = old.generate(request("running"))
        await until(lambda: "running" in engine.queues)
        new = core._link(stub, (("authorization", "Bearer b"),), path)
        assert new is not old and old.retiring and old._reader is not None
        fresh = new.generate(request("fresh"))
        await until(lambda: "fresh" in engine.queues)
        texts = {"running": "", "fresh": ""}
        for _ in range(3):
            engine.step()
            texts["running"] += (await running.read()).text
            texts["fresh"] += (await fresh.read()).text
        ends = [await running.read(), await fresh.read()]
        return texts, ends, old._reader, new._reader is not None

    texts, ends, old_reader, new_open = run(scenario)
    assert texts == {"running": "t1 t2 t3 ", "fresh": "t1 t2 t3 "} and ends == [grpc.aio.EOF] * 2
    assert old_reader is None and new_open, "the old stream closed once its request ended; the new one stays"
