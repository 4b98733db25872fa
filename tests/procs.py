"""Test helpers for tests that start their own processes: free loopback ports and a spawned
group of ranks that is always reaped."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``; kills every rank and fails the test when
    they are not done within ``timeout_s`` (a rank's exception is re-raised by ``join``)."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} ranks did not finish within {timeout_s} s")
