"""``shardserve serve`` until Ctrl-C, as users start the OpenAI front, on a Ray cluster of its own (a
subprocess, not the session's cluster), at TP=2. The other way, ``ray start`` + ``serve deploy`` of
``serve_config.yaml``, runs on three nodes in ``test_multinode.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict:
    """This checkout importable, Ray auth off on both sides, and no pointer to the session's cluster."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
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


def paris(base: str) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="smollm2-135m-instruct", messages=FRANCE, temperature=0,
                                            max_tokens=16)
    text = answer.choices[0].message.content
    assert "Paris" in text
    return text


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


def test_shardserve_serve_tp2_until_ctrl_c(tmp_path):
    http_port, grpc_port = free_port(), free_port()
    log = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "shardserve"), "serve", "--tensor-parallel-size", "2", "--port", str(http_port),
         "--grpc-port", str(grpc_port), "--kv-cache-gib", "0.05", "--max-model-len", "512"],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for("the URLs", lambda: any("Press Ctrl-C to stop." in line for line in lines), 300,
                 alive=lambda: proc.poll() is None)
        out = "".join(lines)
        assert f"http://127.0.0.1:{http_port}/v1" in out and f"127.0.0.1:{grpc_port} (replica 0" in out, out
        text = paris(f"http://127.0.0.1:{http_port}")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**FRANCE[0])]),
                                         sampling=pb.SamplingParams(max_tokens=16, temperature=0))
            assert "".join(r.text for r in pb_grpc.InferenceStub(channel).Generate(request, timeout=60)) == text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        reader.join(10)
        assert "shutting down" in "".join(lines)
        for port in (http_port, grpc_port):
            with socket.socket() as sock, pytest.raises(OSError):
                sock.connect(("127.0.0.1", port))
    finally:
        stop_process_group(proc, signal.SIGINT, 60)
        log.close()
