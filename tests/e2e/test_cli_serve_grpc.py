"""``shardserve serve-grpc`` as a user runs it: a real process with its own local Ray cluster,
TP=2, ready when it prints its address; answers a stub client; stops cleanly on Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from procs import free_port
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]



def test_serve_grpc_tp2_answers_and_stops_on_interrupt(smollm2_files):
    port = free_port()
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.Popen([str(exe), "serve-grpc", "--model", "smollm2-135m-instruct", "--tensor-parallel-size", "2",
                             "--cpus-per-worker", "1", "--kv-cache-gib", "0.05", "--grpc-port", str(port),
                             "--host", "127.0.0.1", "--dtype", "float32"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 240
        line = ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if "gRPC API" in line:
                break
        assert re.search(rf"127\.0\.0\.1:{port}", line), f"no address line; exit code {proc.poll()}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
                                         sampling=pb.SamplingParams(max_tokens=16, temperature=0.0))
            text = "".join(r.text for r in stub.Generate(request))
            assert "Paris" in text
            info = stub.ModelInfo(pb.ModelInfoRequest())
            assert info.tensor_parallel_size == 2 and info.collective == "shm"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
