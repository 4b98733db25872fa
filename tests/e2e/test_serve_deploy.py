"""A ``shardserve serve`` whose replica cannot load must end with that cause as its last line.
(``shardserve serve`` until Ctrl-C, with keys and TLS: ``test_front_door.py``; ``ray start`` +
``serve deploy`` of ``serve_config.yaml`` at TP=2, on three nodes: ``test_multinode.py``.)"""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from procs import BIN, free_port, stop_process_group, subprocess_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_failed_serve_ends_with_its_cause_without_ray_tracebacks(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a GGUF file " * 64)
    proc = subprocess.Popen([str(BIN / "shardserve"), "serve", str(broken), "--port", str(free_port()),
                             "--grpc-port", "0"], env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        stop_process_group(proc, signal.SIGINT, 30)
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]
    # the replica is named by its Serve id (one ModelReplica deployment, any number of replicas)
    assert re.match(r"shardserve: error: replica \w+ failed to load: ValueError: ", last), last
    assert "not a GGUF file" in last
    assert "Traceback" not in out + err and "Application" not in out + err
    assert len((out + err).strip().splitlines()) <= 6, out + err
