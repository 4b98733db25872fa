"""The per-step Unix-socket channel (``workers/step_channel.py``) between a coordinator and its
ranks, with real sockets and threads: answers in order, a rank's exception and a rank's death
reach the coordinator, pipelined plans and results larger than the socket buffers do not deadlock."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardserve.workers.step_channel import ChannelClosed, StepClient, StepServer


def _pair(*executes):
    # each "rank" runs its plans on one thread of its own, as a rank's torch thread does
    servers = [StepServer(fn, ThreadPoolExecutor(max_workers=1).submit) for fn in executes]
    paths = [server.path for server in servers]
    return servers, StepClient(paths), paths


def test_answers_come_back_in_order_from_every_rank_and_the_socket_path_is_gone():
    servers, client, paths = _pair(lambda plan: ("rank0", plan), lambda plan: None)
    try:
        for plan in range(3):   # sent ahead, as async scheduling does
            client.send({"step": plan})
        assert [client.recv() for _ in range(3)] == [[("rank0", {"step": i}), None] for i in range(3)]
        assert not any(os.path.exists(path) or os.path.exists(os.path.dirname(path)) for path in paths)
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_rank_exception_is_raised_by_the_coordinator_and_the_channel_goes_on():
    """The other ranks' late answers to the failed plan are not read as the next plan's."""
    def failing(plan):
        if plan == "bad":
            raise ValueError("rank says no")
        return plan

    def slow_on_bad(plan):   # rank 0 answers the failed plan after rank 1's failure is raised
        if plan == "bad":
            time.sleep(0.3)
        return plan

    servers, client, _ = _pair(slow_on_bad, failing)
    try:
        client.send("bad")
        with pytest.raises(ValueError, match="rank says no"):
            client.recv()
        client.send("good")
        assert client.recv() == ["good", "good"]
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_dead_rank_fails_the_read_at_once_even_while_another_rank_waits_for_it():
    release, inside = threading.Event(), threading.Event()

    def dying(plan):
        inside.set()
        return release.wait(30)

    # rank 0 "stuck in a collective" with rank 1, which dies inside the step
    servers, client, _ = _pair(lambda plan: release.wait(30), dying)
    try:
        client.send("step")
        assert inside.wait(10)
        servers[1].close()
        with pytest.raises(ChannelClosed, match="rank 1"):   # the error names the end that went away
            client.recv()
    finally:
        release.set()
        client.close()
        servers[0].close()


def test_async_reads_and_large_pipelined_plans_and_results_do_not_deadlock():
    big = b"x" * (4 << 20)   # beyond any Unix socket buffer
    servers, client, _ = _pair(lambda plan: (len(plan), big), lambda plan: len(plan))

    async def run():
        for _ in range(3):
            client.send(big)   # none of the results read yet
        return [await client.recv_async() for _ in range(3)]

    try:
        assert asyncio.run(run()) == [[(len(big), big), len(big)]] * 3
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_channel_names_its_ends_in_errors():
    """The draft worker's channel says "the draft worker", not "rank 0" (an outside check read
    "step channel to rank 0 closed (the rank died?)" after killing the draft worker)."""
    server = StepServer(lambda plan: plan, ThreadPoolExecutor(max_workers=1).submit)
    client = StepClient([server.path], names=["the draft worker"])
    try:
        client.send("ping")
        assert client.recv() == ["ping"]
        server.close()
        with pytest.raises(ChannelClosed, match="step channel to the draft worker"):
            client.send("ping")
            client.recv()
    finally:
        client.close()


def test_a_dead_peer_shows_at_once_without_a_plan_in_flight():
    """The draft worker is called only while the policy drafts: between passes, its death must show
    without waiting for a Ray ping (``DraftGroup.check_alive``). An answer not read yet is alive."""
    servers, client, _ = _pair(lambda plan: plan, lambda plan: plan)
    try:
        assert not client.peer_closed()
        client.send("step")
        time.sleep(0.2)                     # both answers buffered, unread
        assert not client.peer_closed()
        assert client.recv() == ["step", "step"]
        servers[1].close()
        deadline = time.monotonic() + 5
        while not client.peer_closed():
            assert time.monotonic() < deadline, "the closed end did not show"
            time.sleep(0.01)
    finally:
        client.close()
        servers[0].close()
