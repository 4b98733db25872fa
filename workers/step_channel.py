"""The per-step channel between the coordinator and a rank on the same node: plans in, results out,
over a Unix socket instead of a Ray actor call.

Why: a Ray actor call costs ~300 us of CPU in the caller and ~300 us in the callee on the 2-core
development machine (``submit_actor_task``, the core worker's IO threads, the task executor), for
a step that computes for ~6 ms on SmolLM2 at batch 1; on few cores that CPU comes straight out of
the rank's OpenMP threads. A length-prefixed pickle over a Unix socket round-trips in ~25 us.

The rank (:class:`StepServer`, opened by :meth:`StepHost.open_step_channel`) listens on a socket
in a fresh private directory (mode 0700: only this user can connect), accepts exactly one
connection and removes the path at once, then runs ``execute(plan)`` on its torch thread for every
message in arrival order and answers each with ``(ok, result or exception)``. Every other call
(load, caches, reload, repair) stays a Ray call. The coordinator (:class:`StepClient`) sends one
pickled plan to every rank (serialized once) and reads the answers in order, blocking or on its
event loop. A rank that dies closes its socket: the read fails at
once (:class:`ChannelClosed`), as a Ray call to a dead actor does. The MTP draft worker serves its
drafting passes the same way (``propose``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
HEADER = struct.Struct("<Q")   # a frame's payload bytes, before the payload (also cluster/replica/local_link.py)


class ChannelClosed(ConnectionError):
    """The other end of a step channel went away (its process died or closed it)."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its length (:data:`HEADER`) in front."""
    return HEADER.pack(len(payload)) + payload


class StepServer:
    """A rank's end: every plan that arrives runs as ``execute(plan)`` through ``submit``, in
    arrival order, and the thread that ran it sends the answer back.

    Args:
        execute: ``plan -> result`` (the rank's ``ShardWorker.execute``).
        submit: ``submit(fn, *args)`` runs ``fn(*args)`` later on one thread, first in first out: the
            rank's torch thread (``workers/torch_thread.py``), so a step costs one thread hand-off.
    """

    def __init__(self, execute: Callable, submit: Callable) -> None:
        self._execute, self._submit = execute, submit
        self._dir = tempfile.mkdtemp(prefix="shardserve-step-")   # mode 0700
        self.path = os.path.join(self._dir, "rank.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._conn: socket.socket | None = None
        self._closed = False
        threading.Thread(target=self._serve, name="shardserve-step-channel", daemon=True).start()

    def _serve(self) -> None:
        """Accept the coordinator, then read plans and hand each to ``submit`` until the channel
        closes. NOTE: reading never waits for a step, so a plan never waits behind a result the
        coordinator has not read yet (both sides blocked on full socket buffers: a deadlock)."""
        try:
            conn, _ = self._listener.accept()
        except OSError:   # closed before anyone connected
            return
        finally:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        self._conn = conn
        try:
            while not self._closed:
                size = HEADER.unpack(_recv_exact(conn, HEADER.size))[0]
                self._submit(self._answer, pickle.loads(_recv_exact(conn, size)))
        except Exception:  # noqa: BLE001 - closed, reset or garbled: no more plans
            self._closed = True
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)   # a coordinator still waiting sees the end at once

    def _answer(self, plan) -> None:
        if self._closed:   # plans read before the channel closed are stale
            return
        try:
            answer = (True, self._execute(plan))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the coordinator
            answer = (False, exc)
        try:
            payload = pickle.dumps(answer, protocol=5)
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle
            payload = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")), protocol=5)
        try:
            self._conn.sendall(frame(payload))
        except OSError:
            self._closed = True

    def close(self) -> None:
        """Stop listening and drop the connection (the coordinator's reads then fail); plans
        already read but not started are dropped."""
        self._closed = True
        for sock in (self._listener, self._conn):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from a blocking socket.

    Raises:
        ChannelClosed: the peer closed the connection first.
    """
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ChannelClosed("step channel closed by the rank")
        got += n
    return bytes(buf)


class StepClient:
    """The coordinator's end of the channels to every rank of a group.

    Args:
        paths: each rank's :attr:`StepServer.path`, in rank order.
        names: each end's name in errors (default ``rank 0``, ``rank 1``, ...).

    Raises:
        OSError: a rank's socket could not be reached.
    """

    def __init__(self, paths: list[str], names: list[str] | None = None) -> None:
        self.names = names or [f"rank {rank}" for rank in range(len(paths))]
        self._socks = []
        try:
            for path in paths:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._socks.append(sock)
                sock.connect(path)
        except OSError:
            self.close()
            raise
        for sock in self._socks:
            sock.setblocking(False)
        self._buffers = [bytearray() for _ in self._socks]
        self._stale = [0] * len(self._socks)   # answers each rank owes to plans whose step already failed

    def send(self, plan) -> None:
        """Send ``plan`` to every rank (pickled once).

        Raises:
            ChannelClosed: a rank's end is gone.
        """
        data = frame(pickle.dumps(plan, protocol=5))
        for rank, sock in enumerate(self._socks):
            try:
                _send_all(sock, data)
            except OSError as exc:
                raise ChannelClosed(f"step channel to {self.names[rank]} closed: {exc}") from exc

    def recv(self) -> list:
        """Every rank's answer to the oldest unanswered plan, blocking; the first failure (an
        exception a rank raised, a closed channel) is raised as soon as it arrives, whichever
        rank it comes from (the others may be stuck in a collective with the failed one)."""
        answers: list = [None] * len(self._socks)
        pending = set(range(len(self._socks)))
        while self._take_buffered(answers, pending):
            ready, _, _ = select.select([self._socks[rank] for rank in pending], [], [])
            for sock in ready:
                self._fill(self._socks.index(sock))
        return answers

    async def recv_async(self) -> list:
        """:meth:`recv` on the running event loop (no thread)."""
        loop = asyncio.get_running_loop()
        answers: list = [None] * len(self._socks)
        pending = set(range(len(self._socks)))
        while self._take_buffered(answers, pending):
            ready = loop.create_future()
            socks = [self._socks[rank] for rank in pending]
            for sock in socks:
                loop.add_reader(sock, lambda s=sock: ready.done() or ready.set_result(s))
            try:
                sock = await ready
            finally:
                for s in socks:
                    loop.remove_reader(s)
            self._fill(self._socks.index(sock))
        return answers

    def _take_buffered(self, answers: list, pending: set[int]) -> bool:
        """Move the whole answers buffered from ``pending`` ranks into ``answers``; True while some
        rank's answer is still missing. A rank's failure is raised at once; the answers the other
        pending ranks still owe to that plan are dropped when they come (not read as the next
        plan's)."""
        for rank in list(pending):
            answer = self._take(rank)
            if answer is None:
                continue
            pending.discard(rank)
            ok, value = answer
            if not ok:
                for other in pending:
                    self._stale[other] += 1
                raise value
            answers[rank] = value
        return bool(pending)

    def _fill(self, rank: int) -> None:
        try:
            chunk = self._socks[rank].recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            raise ChannelClosed(f"step channel to {self.names[rank]} failed: {exc}") from exc
        if not chunk:
            raise ChannelClosed(f"step channel to {self.names[rank]} closed (did it die?)")
        self._buffers[rank] += chunk

    def _take(self, rank: int):
        """The next whole answer buffered from ``rank`` (stale ones dropped), or None."""
        buf = self._buffers[rank]
        while len(buf) >= HEADER.size:
            size = HEADER.unpack_from(buf)[0]
            if len(buf) < HEADER.size + size:
                return None
            payload = bytes(buf[HEADER.size:HEADER.size + size])
            del buf[:HEADER.size + size]
            if not self._stale[rank]:
                return pickle.loads(payload)
            self._stale[rank] -= 1
        return None

    def peer_closed(self) -> bool:
        """Whether some rank's end is gone (its process died: the kernel closed its socket), without
        waiting: one non-blocking peek per rank. Meant for a channel with nothing in flight (an
        answer waiting to be read counts as alive)."""
        for sock in self._socks:
            try:
                if not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return True
            except BlockingIOError:
                continue
            except OSError:
                return True
        return False

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._socks = []


def _send_all(sock: socket.socket, data: bytes) -> None:
    """``sendall`` on a non-blocking socket (a plan larger than the socket buffer waits for room)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            select.select([], [sock], [])


class StepHost:
    """Mixin of a Ray actor whose per-step method (:attr:`step_method`) can also be served over a
    step channel: the shard worker (``execute``) and the MTP draft worker (``propose``)."""

    step_method = "execute"

    def open_step_channel(self, node_id: str) -> str | None:
        """Serve :attr:`step_method` over a Unix socket to a caller on Ray node ``node_id``;
        returns the socket's path, or None when this actor runs on another node (the caller keeps
        Ray calls). A second call replaces the first channel."""
        import ray

        from shardserve.workers.torch_thread import torch_thread_submit

        self.close_step_channel()
        if ray.get_runtime_context().get_node_id() != node_id:
            return None
        try:
            self.step_server = StepServer(getattr(self, self.step_method), torch_thread_submit)
        except OSError as exc:   # e.g. no writable temp dir, or its path too long for a Unix socket
            logger.warning("no step channel (%s): steps come as Ray calls", exc)
            return None
        return self.step_server.path

    def close_step_channel(self) -> None:
        server, self.step_server = getattr(self, "step_server", None), None
        if server is not None:
            server.close()


def connect(actors: list, timeout_s: float | None = None, names: list[str] | None = None) -> StepClient | None:
    """A :class:`StepClient` to every actor in ``actors`` (:class:`StepHost` Ray actors; ``names``
    for errors, see :class:`StepClient`) when all run on this process's node and their sockets
    open, else None (each closes what it opened; the caller keeps Ray calls).

    Raises:
        ray.exceptions.RayError: an actor died or did not answer within ``timeout_s``.
    """
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    paths = ray.get([actor.open_step_channel.remote(node_id) for actor in actors], timeout=timeout_s)
    if all(paths):
        try:
            return StepClient(paths, names)
        except OSError as exc:
            logger.warning("no step channel (%s): steps go as Ray calls", exc)
    ray.get([actor.close_step_channel.remote() for actor in actors], timeout=timeout_s)
    return None
