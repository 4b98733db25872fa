"""The router's link to one replica: every request to it over one ``GenerateStream`` call.

A per-request ``Generate`` call costs a gRPC message per streamed token on both sides; over the
link, one message carries what an engine step produced for all of this router's requests on the
replica (``cluster/replica/grpc_server.py: StreamLink`` batches them), so at many concurrent
streams the per-token cost of the hop is a fraction of a message. A single stream is never held
back: the replica sends as soon as a step's outputs are in.

:meth:`ReplicaLink.generate` returns a :class:`LinkCall` that behaves as the grpc.aio call the
router used before (``read()`` -> response or ``grpc.aio.EOF``, ``cancel()``, failures raised as
``grpc.aio.AioRpcError`` with the status ``Generate`` would end with), so the router's request
handling is the same for both. A request's deadline is kept on both sides: the replica ends it
(DEADLINE_EXCEEDED, blocks freed) and the link fails it locally if the replica does not answer.

When the call itself fails (the replica died or moved), every open request fails with its status
and the next request opens a new call. A replica without ``GenerateStream`` (an older version during
a rolling upgrade) answers UNIMPLEMENTED: its requests, those already sent included, then go over
one ``Generate`` call each. A replica on this machine is reached over its local socket instead
(``cluster/replica/local_link.py``: the same messages, a fraction of gRPC's CPU per message).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque

import grpc

from shardserve.cluster.replica.local_link import LocalStreamCall
from shardserve.proto import inference_pb2 as pb

logger = logging.getLogger(__name__)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_DEADLINE_GRACE_S = 0.5   # the replica ends a request at its deadline; the link only if it does not


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a grpc.aio call raises, for ``code`` and ``details``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class LinkCall:
    """One request on a :class:`ReplicaLink` (the grpc.aio unary-stream call interface the router uses)."""

    def __init__(self, link: ReplicaLink, request: pb.GenerateRequest, deadline: float | None) -> None:
        self.link, self.request, self.deadline = link, request, deadline   # deadline: event-loop time
        self.request_id = request.request_id
        self._fallback = None            # the per-request Generate call, once the replica lacks the stream
        self._items: deque = deque()     # GenerateResponse, then EOF; or an AioRpcError
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.done = False                # ended (last response or error received) or cancelled

    def _push(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _deliver(self, resp: pb.GenerateResponse) -> None:
        self._push(resp)
        if resp.finish_reason:
            self._end(grpc.aio.EOF)

    def _end(self, item) -> None:
        if not self.done:
            self._close()
            self._push(item)

    def _close(self) -> None:
        self.done = True
        link = self.link
        link.calls.pop(self.request_id, None)
        if self._timer is not None:
            self._timer.cancel()
        if link.retiring and not link.calls:
            link.close()

    def _expire(self) -> None:
        """The deadline passed without the replica ending the request: end it here and abort it there."""
        if not self.done:
            self.link.send(pb.StreamRequest(cancel=self.request_id))
            self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    async def read(self):
        """The next response, ``grpc.aio.EOF`` after the last one.

        Raises:
            grpc.aio.AioRpcError: the request failed (its status as ``Generate`` would end with).
        """
        while not self._items:
            if self._fallback is not None:
                return await self._fallback.read()
            if self.done:   # cancelled, or read again after EOF
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items.popleft()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def cancel(self) -> bool:
        """Abort the request on the replica (frees its blocks); no-op once it ended."""
        if self._fallback is not None:
            return self._fallback.cancel()
        if self.done:
            return False
        self._close()
        self.link.send(pb.StreamRequest(cancel=self.request_id))
        return True

    def _fall_back(self) -> None:
        """Continue over a ``Generate`` call of its own (the replica has no ``GenerateStream``)."""
        if self.done:
            return
        self._close()
        timeout = None if self.deadline is None else max(0.0, self.deadline - asyncio.get_running_loop().time())
        self._fallback = self.link.per_request_call(self.request, timeout)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class ReplicaLink:
    """One ``GenerateStream`` call to a replica, opened on first use and again after it failed.

    Args:
        stub: the replica's ``InferenceStub``.
        metadata: call metadata (the API key).
        local_path: the replica's local socket when it runs on this machine: the call goes there
            (``cluster/replica/local_link.py``, the same messages without HTTP/2) instead of ``stub``.
    """

    def __init__(self, stub, metadata: tuple = (), local_path: str | None = None) -> None:
        self._stub = weakref.ref(stub)   # the router keys its links by stub: no cycle keeping it alive
        self.metadata, self.local_path = metadata, local_path
        self.calls: dict[str, LinkCall] = {}
        self._outgoing: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self.streams = True              # False once the replica answered UNIMPLEMENTED
        self.retiring = False            # replaced by a new link: closes when its last request ends
        self.num_batches = 0             # messages received (one per engine step with output for us)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
        """Start ``request`` (its ``request_id`` unique on this link) with an optional deadline in
        seconds; returns a :class:`LinkCall` (a plain ``Generate`` call on a replica without the stream)."""
        if not self.streams:
            return self.per_request_call(request, timeout)
        if self._reader is None or self._reader.done():
            self._open()
        loop = asyncio.get_running_loop()
        call = LinkCall(self, request, None if timeout is None else loop.time() + timeout)
        self.calls[request.request_id] = call
        self.send(pb.StreamRequest(generate=request, timeout_s=timeout or 0.0))
        if timeout:
            call._timer = loop.call_later(timeout + _DEADLINE_GRACE_S, call._expire)
        return call

    def per_request_call(self, request: pb.GenerateRequest, timeout: float | None):
        """``Generate(request)`` as a call of its own."""
        return self._stub().Generate(request, timeout=timeout, metadata=self.metadata)

    def send(self, msg: pb.StreamRequest) -> None:
        if self._outgoing is not None:
            self._outgoing.put_nowait(msg)

    def _open(self) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        self._outgoing = queue

        async def requests():
            while True:
                yield await queue.get()

        if self.local_path is not None:
            call = LocalStreamCall(self.local_path, dict(self.metadata).get("authorization", ""), requests())
        else:
            call = self._stub().GenerateStream(requests(), metadata=self.metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read(call, queue))

    async def _read(self, call, queue: asyncio.Queue) -> None:
        try:
            async for batch in call:
                self.num_batches += 1
                for resp in batch.responses:
                    target = self.calls.get(resp.request_id)
                    if target is not None:
                        target._deliver(resp)
                for err in batch.errors:
                    target = self.calls.get(err.request_id)
                    if target is not None:
                        target._end(rpc_error(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.details))
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica closed the stream")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.streams = False
                logger.info("the replica has no GenerateStream (an older version): one Generate call per request")
                for target in list(self.calls.values()):
                    target._fall_back()
                return
            error = exc
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            if self._outgoing is queue:
                self._outgoing = None
        for target in list(self.calls.values()):
            target._end(error)

    def close(self) -> None:
        """Close the stream (the router shuts down); open requests end with UNAVAILABLE. A request
        started afterwards opens a new stream (the cancelled reader is not reused: it would never
        read that request's answers)."""
        if self._reader is not None:
            self._reader.cancel()
        self._reader, self._outgoing = None, None
        for target in list(self.calls.values()):
            target._end(rpc_error(grpc.StatusCode.UNAVAILABLE, "the router's link to the replica closed"))

    def retire(self) -> None:
        """Close once the requests open on it have ended (the router opened a new link to the
        replica: its token or socket changed); they finish over this stream meanwhile."""
        self.retiring = True
        if not self.calls:
            self.close()
