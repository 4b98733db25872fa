"""Starting the OpenAI front on a Ray cluster of its own (subprocesses, not the session's cluster):
``ray start --head`` + ``serve deploy serve_config.yaml`` at TP=2, checking where Ray placed every
shard worker; and a ``shardserve serve`` whose replica cannot load, which must end with that cause
as its last line. (``shardserve serve`` until Ctrl-C, with keys and TLS: ``test_front_door.py``.)"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import yaml

from procs import BIN, free_port, stop_process_group, subprocess_env, wait_for
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


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
    assert last.startswith("shardserve: error: replica 0 failed to load: ValueError: ") and "not a GGUF file" in last
    assert "Traceback" not in out + err and "Application" not in out + err
    assert len((out + err).strip().splitlines()) <= 6, out + err
