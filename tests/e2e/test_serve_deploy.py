"""The two ways users start the OpenAI front, each on a Ray cluster of its own (subprocesses, not the
session's cluster): ``ray start --head`` + ``serve deploy serve_config.yaml``, and ``shardserve serve``
until Ctrl-C. Both run TP=2; the deploy test also checks where Ray placed every shard worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import yaml

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


def all_replicas_ready(base: str) -> dict | None:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = json.loads(err.read())
    states = [r["state"] for r in body.get("replicas", [])]
    assert "failed" not in states, body
    return body if states and all(s == "ready" for s in states) else None


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


def ray_list(kind: str, dashboard: str, env: dict) -> list[dict]:
    out = subprocess.run([str(BIN / "ray"), "list", kind, "--address", dashboard, "--detail", "--format", "json",
                          "--limit", "1000"], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_ray_serve_deploy_of_serve_config_serves_tp2(tmp_path):
    gcs, dash, agent, client, http_port, grpc_port = (free_port() for _ in range(6))
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert config["applications"][0]["import_path"] == "shardserve.cluster.serve_app:build_app"
    assert config["applications"][0]["args"]["tensor_parallel_size"] == 2
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["applications"][0]["args"].update(grpc_port=grpc_port, grpc_host="127.0.0.1", kv_cache_gib=0.05,
                                             max_model_len=512)
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    env, dashboard = subprocess_env(), f"http://127.0.0.1:{dash}"
    ray_tmp = tempfile.mkdtemp(prefix="ssray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=8",
         f"--temp-dir={ray_tmp}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"],
        env=env, stdout=open(tmp_path / "ray_start.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the dashboard", lambda: urllib.request.urlopen(dashboard + "/api/version", timeout=2).read(), 120,
                 alive=lambda: head.poll() is None)
        deployed = subprocess.run([str(BIN / "serve"), "deploy", str(tmp_path / "serve_config.yaml"), "-a", dashboard],
                                  env=env, capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stderr
        base = f"http://127.0.0.1:{http_port}"
        health = wait_for("all replicas ready", lambda: all_replicas_ready(base), 300)
        assert [r["address"] for r in health["replicas"]] == [f"127.0.0.1:{grpc_port}"]
        text = paris(base)
        # TP inside the Serve replica: both shard workers sit in bundles 1 and 2 of the replica's own group
        actors = [a for a in ray_list("actors", dashboard, env) if a["state"] == "ALIVE"]
        (replica,) = [a for a in actors if "ModelReplica0" in a["class_name"]]
        workers = [a for a in actors if a["class_name"] == "ShardWorker"]
        assert len(workers) == 2 and {w["placement_group_id"] for w in workers} == {replica["placement_group_id"]}
        groups = [g for g in ray_list("placement-groups", dashboard, env) if g["state"] == "CREATED"]
        assert len(groups) == 1 and len(groups[0]["bundles"]) == 3       # no second, nested group
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**FRANCE[0])]),
                                         sampling=pb.SamplingParams(max_tokens=16, temperature=0))
            assert "".join(r.text for r in pb_grpc.InferenceStub(channel).Generate(request, timeout=60)) == text
        shutdown = subprocess.run([str(BIN / "serve"), "shutdown", "-a", dashboard, "-y"], env=env,
                                  capture_output=True, text=True, timeout=120)
        assert shutdown.returncode == 0, shutdown.stderr
    finally:
        stop_process_group(head, signal.SIGTERM, 60)  # `ray stop` would stop every Ray on the machine
        shutil.rmtree(ray_tmp, ignore_errors=True)


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
