"""Time back to serving after a worker dies: in-place repair vs Ray Serve replacing the replica.

One real ``shardserve serve`` (SmolLM2, TP=2, its own local Ray cluster) is started, then, in the
same run: a shard worker is SIGKILLed (the replica repairs itself in place), a hot-swap reload of
the unchanged files is timed, and the replica process itself is SIGKILLed (Ray Serve replaces
the whole replica, every rank reloading its weights). Each time is from the kill (or request) to
``/health`` answering 200 again. Run with ``make bench``; not a test. Timings on a shared machine
are noisy: compare the ratio of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from shardserve.cluster.ports import unused_port
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc


def health(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def until(check, timeout_s: float, period_s: float = 0.1) -> float:
    """Seconds until ``check()`` is true (raises TimeoutError after ``timeout_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(period_s)
    raise TimeoutError(f"not within {timeout_s} s")


def workers(stub) -> dict:
    return {(w.role, w.rank): w.pid for w in stub.ModelInfo(pb.ModelInfoRequest(), timeout=10).workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    ns = parser.parse_args()
    http_port, grpc_port = unused_port(), unused_port()
    base = f"http://127.0.0.1:{http_port}"
    log = tempfile.NamedTemporaryFile("w", prefix="bench_recovery_", suffix=".log", delete=False)
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "shardserve"), "serve", ns.model, "-tp",
                             str(ns.tensor_parallel_size), "--port", str(http_port), "--grpc-port", str(grpc_port),
                             "--kv-cache-gib", "0.05", "--max-model-len", "512"],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    rows = []
    try:
        until(lambda: any("Press Ctrl-C" in line for line in lines), 900, 0.5)
        rows.append(("cold start (shardserve serve to ready)", time.monotonic() - started))
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        until(lambda: ("shard", 1) in workers(stub), 60)
        os.kill(workers(stub)["shard", 1], signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: health(base) == 503, 30, 0.02)
        until(lambda: health(base) == 200, 300)
        in_place = time.monotonic() - killed
        rows.append(("SIGKILL shard rank 1 -> healthy (in-place repair)", in_place))
        request = urllib.request.Request(base + "/admin/reload_weights", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(request, timeout=600) as resp:
            answer = json.loads(resp.read())
        rows.append((f"hot-swap reload, unchanged files ({answer['unchanged_tensors']} tensors)", time.monotonic() - t0))
        os.kill(workers(stub)["coordinator", 0], signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: health(base) == 503, 60, 0.05)
        until(lambda: health(base) == 200, 600, 0.25)
        replaced = time.monotonic() - killed
        rows.append(("SIGKILL replica process -> healthy (Serve replaces it)", replaced))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"{ns.model}, TP={ns.tensor_parallel_size} (server log: {log.name})")
    for what, seconds in rows:
        print(f"  {what:<62} {seconds:7.1f} s")
    if len(rows) == 4:
        print(f"  Serve replacement / in-place repair: {rows[3][1] / rows[1][1]:.1f}x (same run)")


if __name__ == "__main__":
    main()
