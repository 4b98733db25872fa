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

Protocol: frames of an 8-byte little-endian length and that many bytes (the step channel's framing,
``workers/step_channel.py``). The client's first frame is its ``authorization`` value (``Bearer
<token>``), checked as gRPC metadata is (a refused caller's connection is closed); then ``StreamRequest`` frames in and ``StreamResponse`` frames out. The
socket lives in a fresh directory of mode 0700 (only this user can connect). The client closing
the connection aborts every request it started (as cancelling the gRPC call does); so does
half-closing it (over gRPC a half-closed call still gets its answers: the router never half-closes).
A connection that has not sent its first frame within 10 s is closed. A replica killed before it
could stop leaves its directory behind: the next one started as the same user removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from shardserve.cluster.replica.grpc_server import StreamLink
from shardserve.proto import inference_pb2 as pb
from shardserve.workers.step_channel import HEADER, frame

logger = logging.getLogger(__name__)
_PREFIX = "shardserve-link-"
_MAX_AUTHORIZATION_BYTES = 4096
_MAX_RESPONSE_BYTES = 1 << 30
_AUTH_TIMEOUT_S = 10.0      # a connection that does not say who it is by then is closed
_STALE_AFTER_S = 60.0       # a link directory older than this whose socket refuses connections is left over


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's payload; None at a clean end of the stream.

    Raises:
        ValueError: the frame is longer than ``max_bytes``.
        asyncio.IncompleteReadError: the stream ended inside a frame.
    """
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    size = HEADER.unpack(header)[0]
    if size > max_bytes:
        raise ValueError(f"a {size}-byte frame is over the {max_bytes}-byte limit")
    return await reader.readexactly(size)


def remove_stale_links(folder: str | None = None, stale_after_s: float = _STALE_AFTER_S) -> list[str]:
    """Remove the link directories in ``folder`` (default: the temporary folder) that a replica
    left behind when it died: older than ``stale_after_s`` and nothing listening on their socket
    (a live replica's socket is bound within milliseconds of its directory's creation). Another
    user's directories are not readable and stay. Returns the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(folder or tempfile.gettempdir(), _PREFIX + "*")):
        try:
            if time.time() - os.stat(path).st_mtime < stale_after_s:
                continue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(os.path.join(path, "link.sock"))
                continue   # somebody listens: a live replica
            except (ConnectionRefusedError, FileNotFoundError):
                pass
            finally:
                probe.close()
        except OSError:   # not ours (permissions), gone meanwhile, or busy: leave it
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


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
        """Listen on a fresh socket; returns its path. Directories left by replicas of this user
        that died without stopping (SIGKILL, OOM) are removed first."""
        await asyncio.to_thread(remove_stale_links)
        self._dir = tempfile.mkdtemp(prefix=_PREFIX)   # mode 0700
        path = os.path.join(self._dir, "link.sock")
        self._server = await asyncio.start_unix_server(self._serve, path)
        self.path = path
        return path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = None
        self._writers.add(writer)
        try:
            authorization = await asyncio.wait_for(read_frame(reader, _MAX_AUTHORIZATION_BYTES), _AUTH_TIMEOUT_S)
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
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
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
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, DecodeError) as exc:
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
                    if payload is None:
                        raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica closed the local link")
                    batch = pb.StreamResponse.FromString(payload)
                except (ConnectionError, asyncio.IncompleteReadError, ValueError, DecodeError) as exc:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the local link failed: {exc}") from None
                yield batch
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
