"""The router's link to a replica on the same machine: the ``GenerateStream`` protocol over a Unix
socket instead of HTTP/2.

Why: on the 2-core development machine a message streamed by grpc.aio costs ~77 us of CPU to send
and ~86 us to receive; the same protobuf, length-prefixed on a Unix socket, ~12 and ~18 us (a
message every 5 ms, uvloop on both sides). At one client every token is one message, and on few
cores that CPU comes out of the ranks' step time (``benchmarks/cpu_per_token.py``). vLLM's API
server and engine core talk over ZMQ IPC for the same reason. Everything above the transport is
the gRPC link's: :class:`cluster.replica.grpc_server.StreamLink` on the replica,
:class:`cluster.frontend.replica_link.ReplicaLink` on the router; other routers, other machines and
clients keep gRPC.

Protocol: frames of a 4-byte little-endian length and that many bytes. The client's first frame is
its ``authorization`` value (``Bearer <token>``), checked as gRPC metadata is (a refused caller's
connection is closed); then ``StreamRequest`` frames in and ``StreamResponse`` frames out. The
socket lives in a fresh directory of mode 0700 (only this user can connect). The client closing
the connection aborts every request it started (as cancelling the gRPC call does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator

import grpc

from shardserve.cluster.replica.grpc_server import StreamLink
from shardserve.proto import inference_pb2 as pb

logger = logging.getLogger(__name__)
_LENGTH_BYTES = 4
_MAX_AUTHORIZATION_BYTES = 4096
_MAX_RESPONSE_BYTES = 1 << 30


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front."""
    return len(payload).to_bytes(_LENGTH_BYTES, "little") + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's payload; None at a clean end of the stream.

    Raises:
        ValueError: the frame is longer than ``max_bytes``.
        asyncio.IncompleteReadError: the stream ended inside a frame.
    """
    try:
        header = await reader.readexactly(_LENGTH_BYTES)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    size = int.from_bytes(header, "little")
    if size > max_bytes:
        raise ValueError(f"a {size}-byte frame is over the {max_bytes}-byte limit")
    return await reader.readexactly(size)


class LocalLinkServer:
    """The replica's end: serves ``GenerateStream`` of ``servicer`` (an ``InferenceServicer``) on a
    Unix socket; :attr:`path` is what the router connects to (None until :meth:`start`)."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer
        self.path: str | None = None
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()   # open connections (closed by stop())

    async def start(self) -> str:
        """Listen on a fresh socket; returns its path."""
        self._dir = tempfile.mkdtemp(prefix="shardserve-link-")   # mode 0700
        path = os.path.join(self._dir, "link.sock")
        self._server = await asyncio.start_unix_server(self._serve, path)
        self.path = path
        return path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = None
        self._writers.add(writer)
        try:
            authorization = await read_frame(reader, _MAX_AUTHORIZATION_BYTES)
            if authorization is None:   # closed before saying who it is
                return
            caller = self.servicer.front.identify(authorization.decode(errors="replace") or None)
            if caller is None:
                logger.warning("local link: a connection without a valid key was closed")
                return
            link = StreamLink(self.servicer, caller)
            reading = asyncio.create_task(self._read(link, reader))
            try:
                while (batch := await link.next_batch()) is not None:
                    if writer.is_closing():
                        return
                    writer.write(frame(batch.SerializeToString()))
                    await writer.drain()
            finally:
                reading.cancel()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            logger.debug("local link closed: %s: %s", type(exc).__name__, exc)
        finally:
            if link is not None:
                link.close()   # the router went away: abort what it started (frees their blocks)
            self._writers.discard(writer)
            writer.close()

    async def _read(self, link, reader: asyncio.StreamReader) -> None:
        """Hand the client's requests to ``link``; once it closes the connection (or sends a bad
        frame), abort everything it started."""
        limit = self.servicer.front.limits.max_request_body_bytes

        async def requests():
            while (payload := await read_frame(reader, limit)) is not None:
                yield pb.StreamRequest.FromString(payload)

        try:
            await link.read(requests())
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:   # DecodeError is one
            logger.debug("local link: reading stopped: %s: %s", type(exc).__name__, exc)
        finally:
            link.close()
            link.half_closed = True
            link.ready.set()   # the writer sees the call is over

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening, close every connection (their requests are aborted) and remove the socket."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            with contextlib.suppress(Exception):   # Python >= 3.12 waits for the connections' handlers too
                await asyncio.wait_for(self._server.wait_closed(), timeout_s)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class LocalStreamCall:
    """The router's end: one ``GenerateStream`` call over the local socket at ``path``, used as the
    grpc.aio call it replaces (``async for batch in call``, ``cancel()``); the connection failing
    or closing raises ``grpc.aio.AioRpcError`` UNAVAILABLE, as a gRPC call to a dead replica does.

    Args:
        path: the replica's socket (its status' ``local_address``).
        authorization: the ``authorization`` metadata value the gRPC call would carry.
        requests: the ``StreamRequest`` messages to send, as they come.
    """

    def __init__(self, path: str, authorization: str, requests: AsyncIterator[pb.StreamRequest]) -> None:
        self.path, self._authorization, self._requests = path, authorization, requests
        self._writer: asyncio.StreamWriter | None = None
        self._sender: asyncio.Task | None = None

    def __aiter__(self) -> AsyncIterator[pb.StreamResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[pb.StreamResponse]:
        from shardserve.cluster.frontend.replica_link import rpc_error

        try:
            reader, self._writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"local link {self.path}: {exc}") from None
        self._writer.write(frame(self._authorization.encode()))
        self._sender = asyncio.create_task(self._send(self._writer))
        try:
            while True:
                try:
                    payload = await read_frame(reader, _MAX_RESPONSE_BYTES)
                except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the local link failed: {exc}") from None
                if payload is None:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica closed the local link")
                yield pb.StreamResponse.FromString(payload)
        finally:
            self.cancel()

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        try:
            async for msg in self._requests:
                writer.write(frame(msg.SerializeToString()))
                await writer.drain()
        except ConnectionError:
            pass   # the reader reports the failure

    def cancel(self) -> bool:
        """Close the connection: the replica aborts every request sent on it."""
        if self._sender is not None:
            self._sender.cancel()
        if self._writer is not None:
            self._writer.close()
        return True
