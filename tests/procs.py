"""Test helpers for tests that start their own processes: free loopback ports, a spawned group of
ranks that is always reaped, and the environment, readiness wait and clean stop of a subprocess
(``shardserve serve``, ``ray start``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from shardserve.cluster.ports import unused_port

BIN = Path(sys.executable).parent   # this venv's console scripts (shardserve, ray, serve)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now that a starting Ray cluster will not take before the
    server under test binds it (``cluster/ports.py``), and never one handed out before in this
    test process: a server's ``--port``, ``--grpc-port`` and ``--replica-grpc-port`` were three
    independent draws of a port that is free *now*, the same port twice about once in 4,000
    starts, and the second server socket then failed to bind."""
    port = unused_port("127.0.0.1", avoid=_HANDED_OUT)
    _HANDED_OUT.add(port)
    return port


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


def subprocess_env() -> dict:
    """Ray auth off on both sides and no pointer to the session's cluster. This checkout is found
    through its editable install (the repository root is not put on the path: its ``proto/`` folder
    would shadow proto-plus)."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return env


def wait_for(what: str, check, timeout_s: float, alive=None):
    """Poll ``check()`` until it returns a truthy value; fail early when ``alive()`` is False."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise AssertionError(f"process exited while waiting for {what}")
        try:
            result = check()
        except (OSError, ValueError):
            result = None
        if result:
            return result
        time.sleep(0.3)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def stop_process_group(proc: subprocess.Popen, sig: int, timeout_s: float) -> int | None:
    """Signal ``proc`` (we started it in a session of its own), wait, then SIGKILL its group."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its own process group
    except ProcessLookupError:
        pass
    return proc.wait(10)
