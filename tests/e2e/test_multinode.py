"""A replica whose ranks sit on different Ray nodes, and rolling upgrades under load, as users run
them: a Ray cluster of three nodes on this machine (three `ray start` processes), the app deployed
with `serve deploy` at TP=2 with STRICT_SPREAD, so the coordinator and each rank run on nodes of
their own and the ranks all-reduce over gloo (TCP), never shared memory. The same cluster then
takes a changed config, a config whose model does not exist, one whose model cannot load, and the
changed config again, while clients keep sending requests: none may fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from procs import free_port, subprocess_env

from shardserve.cluster.engine.request import SamplingParams
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]   # 3 Ray nodes, ~6 min: make test-all
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time"
LONG_TOKENS = 96
NUM_NODES, CPUS_PER_NODE = 3, 3   # STRICT_SPREAD: 3 bundles on 3 nodes, twice while a replica is replaced


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.3):
    """Poll ``check()`` until it returns a truthy value (``OSError``/``ValueError`` count as not yet)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            result = check()
        except (OSError, ValueError) as exc:
            result, last = None, exc
        if result:
            return result
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s (last error: {last})")


def get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"{}")


@dataclass
class Cluster:
    """Three Ray nodes started with `ray start` in process groups of their own."""

    dashboard: str
    env: dict
    tmp: Path
    procs: list = field(default_factory=list)
    gcs: str = ""   # host:port of the head's GCS

    def ray_list(self, kind: str) -> list[dict]:
        """Ray's state API (what `ray list KIND --detail` prints), from the dashboard."""
        body = get_json(f"{self.dashboard}/api/v0/{kind}?limit=1000&detail=1&timeout=30")
        if not body.get("result"):
            raise ValueError(f"state API: {body.get('msg')}")
        return body["data"]["result"]["result"]

    def alive(self) -> int:
        return len([n for n in self.ray_list("nodes") if n["state"] == "ALIVE"])

    def deploy(self, config: dict, name: str) -> None:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        done = subprocess.run([str(BIN / "serve"), "deploy", str(path), "-a", self.dashboard], env=self.env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr

    def app(self) -> dict:
        return get_json(f"{self.dashboard}/api/serve/applications/")["applications"].get("shardserve", {})

    def stop(self) -> None:
        for proc in reversed(self.procs):   # `ray stop` would stop every Ray on the machine
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10    # nodes drain for up to 30 s: the test is over, don't wait
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_node(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "ray"), "start", "--block", f"--num-cpus={CPUS_PER_NODE}",
                             f"--dashboard-agent-listen-port={free_port()}", "--min-worker-port=0",
                             "--max-worker-port=0", "--object-store-memory=150000000", "--disable-usage-stats",
                             "--node-ip-address=127.0.0.1",
                             *args], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    gcs, dash, client = free_port(), free_port(), free_port()
    env = subprocess_env()
    ray_tmp = tempfile.mkdtemp(prefix="ssmn", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
    nodes = Cluster(f"http://127.0.0.1:{dash}", env, tmp, gcs=f"127.0.0.1:{gcs}")
    try:
        nodes.procs.append(start_node(
            ["--head", f"--port={gcs}", f"--temp-dir={ray_tmp}", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}"],
            env, tmp / "head.log"))
        wait_for("the dashboard", lambda: urllib.request.urlopen(nodes.dashboard + "/api/version", timeout=2).read(),
                 120)
        for count in range(2, NUM_NODES + 1):   # one by one: a loaded GCS times out concurrent joins
            for attempt in range(3):           # `ray start` gives up on a slow raylet after 30 s
                proc = start_node([f"--address=127.0.0.1:{gcs}", f"--temp-dir={ray_tmp}"], env,
                                  tmp / f"node{count}-{attempt}.log")
                nodes.procs.append(proc)
                wait_for(f"node {count}", lambda: proc.poll() is not None or nodes.alive() == count, 120, 1)
                if proc.poll() is None:
                    break
            assert nodes.alive() == count, f"node {count} did not start: see {tmp}"
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def serve_config(http_port: int, grpc_port: int, **args) -> dict:
    """``serve_config.yaml`` (the file users deploy) on local ports, spread over the nodes."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert config["applications"][0]["import_path"] == "shardserve.cluster.serve_app:build_app"
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["applications"][0]["args"].update(
        tensor_parallel_size=2, placement_strategy="STRICT_SPREAD", cpus_per_worker=1, grpc_port=grpc_port,
        grpc_host="127.0.0.1", kv_cache_gib=0.05, max_model_len=512, drain_timeout_s=60,
        dtype="float32", **args)   # as smollm2_llm, the oracle: bf16 answers depend on the CPU's bf16 units (AMX)
    return config


@dataclass
class App:
    base: str
    grpc_port: int
    config: dict


def all_ready(base: str) -> dict | None:
    """The app serves: ``/health`` says ok (one replica here: ``data_parallel_size`` 1)."""
    body = get_json(base + "/health")
    assert body.get("status") != "unhealthy", body
    return body if body.get("status") == "ok" else None


@pytest.fixture(scope="module")
def app(cluster):
    http_port, grpc_port = free_port(), free_port()
    config = serve_config(http_port, grpc_port)
    cluster.deploy(config, "v1")
    base = f"http://127.0.0.1:{http_port}"
    wait_for("the app", lambda: all_ready(base), 400, interval_s=1)
    return App(base, grpc_port, config)


def test_serve_refuses_to_join_a_cluster_without_token_auth(cluster):
    """Issue 27: this cluster runs with RAY_AUTH_MODE=disabled; ``serve --address`` says so in one line
    (exit code 2) and deploys nothing."""
    done = subprocess.run([str(BIN / "shardserve"), "serve", "--address", cluster.gcs, "--port", str(free_port())],
                          env=cluster.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and "token authentication off" in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("shardserve: error:") == 1 and "--allow-ray-without-auth" in done.stderr


def chat(base: str, stream: bool = False, max_tokens: int = 16) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=max_tokens,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=max_tokens)
    return answer.choices[0].message.content


def test_strict_spread_puts_coordinator_and_each_rank_on_its_own_node_with_gloo(cluster, app, smollm2_llm):
    actors = [a for a in cluster.ray_list("actors") if a["state"] == "ALIVE"]
    (replica,) = [a for a in actors if a["class_name"].endswith(":ModelReplica")]
    workers = sorted((a for a in actors if a["class_name"] == "ShardWorker"), key=lambda a: a["actor_id"])
    nodes = [replica["node_id"]] + [w["node_id"] for w in workers]
    assert len(workers) == 2 and len(set(nodes)) == 3, nodes
    assert {w["placement_group_id"] for w in workers} == {replica["placement_group_id"]}   # the replica's own group
    (group,) = [g for g in cluster.ray_list("placement_groups") if g["state"] == "CREATED"]   # none nested
    assert len({bundle["node_id"] for bundle in group["bundles"]}) == len(group["bundles"]) == 3   # STRICT_SPREAD
    with grpc.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**FRANCE[0])]),
                                     sampling=pb.SamplingParams(max_tokens=16, temperature=0))
        grpc_answer = "".join(r.text for r in stub.Generate(request, timeout=120))
    assert (info.collective, info.num_nodes, info.coordinator_node) == ("gloo", 3, replica["node_id"])
    assert sorted(info.rank_nodes) == sorted(w["node_id"] for w in workers)
    with urllib.request.urlopen(app.base + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert re.search(r'^shardserve_replica_nodes\{replica="\w+"\} 3\.0$', metrics, re.M)
    assert f'collective="gloo",coordinator_node="{replica["node_id"]}"' in metrics
    for rank, (node, ip) in enumerate(zip(info.rank_nodes, info.rank_node_ips)):
        assert re.search(rf'^shardserve_rank_node_info\{{node_id="{node}",node_ip="{re.escape(ip)}",rank="{rank}",'
                         rf'replica="\w+"\}} 1\.0$', metrics, re.M)
    # greedy answers equal the single-node engine's (one process, no collective)
    client = openai.OpenAI(base_url=app.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    story = client.completions.create(model=MODEL, prompt=STORY, max_tokens=16, temperature=0).choices[0].text
    expected = smollm2_llm.generate([FRANCE, STORY], SamplingParams(max_tokens=16, temperature=0))
    assert [chat(app.base), grpc_answer, story] == [expected[0].text, expected[0].text, expected[1].text]
    assert "Paris" in expected[0].text


class Clients:
    """Threads sending requests back to back until stopped: short chats (every other one streamed)
    and long streamed completions (``LONG_TOKENS``, so a stream is always running when a replica is
    replaced: a replica stopped before its drain ends cuts it); each result is
    ``(ok, kind, text or error)``."""

    def __init__(self, base: str, num_threads: int = 2, long_threads: int = 1) -> None:
        self.base, self.results, self._stop = base, [], threading.Event()
        kinds = ["chat"] * num_threads + ["long"] * long_threads
        self.threads = [threading.Thread(target=self._run, args=(i, kind), daemon=True) for i, kind in enumerate(kinds)]
        for thread in self.threads:
            thread.start()

    def _run(self, seed: int, kind: str) -> None:
        stream = bool(seed % 2)
        while not self._stop.is_set():
            try:
                text = long_story(self.base) if kind == "long" else chat(self.base, stream=stream, max_tokens=8)
                self.results.append((True, kind, text))
            except Exception as exc:  # noqa: BLE001 - a failure is what the test counts
                self.results.append((False, kind, f"{type(exc).__name__}: {exc}"))
            stream = not stream

    def wait_for_more(self, count: int, timeout_s: float = 120) -> None:
        target = len(self.results) + count
        wait_for(f"{count} more answers", lambda: len(self.results) >= target, timeout_s)

    def stop(self) -> list:
        self._stop.set()
        for thread in self.threads:
            thread.join(180)
        return self.results


def long_story(base: str) -> str:
    """A streamed completion of ``LONG_TOKENS`` tokens; returns how it ended: ``"length 96"``."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=LONG_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return f"{finish} {chunks[-1].usage.completion_tokens}"


def replica_ids(app_status: dict) -> dict[str, set[str]]:
    return {name: {r["replica_id"] for r in d.get("replicas", [])} for name, d in app_status["deployments"].items()}


def running(cluster: Cluster, config: dict, replaced: dict[str, set[str]] | None = None) -> dict | None:
    """The app runs ``config`` with one replica per deployment (none of ``replaced`` left)."""
    status = cluster.app()
    if status.get("status") != "RUNNING" or \
            status.get("deployed_app_config", {}).get("args") != config["applications"][0]["args"]:
        return None
    now = replica_ids(status)
    done = all(len(ids) == 1 and not ids & (replaced or {}).get(name, set()) for name, ids in now.items())
    return status if done else None


def failed_deploy(cluster: Cluster, model: str) -> dict | None:
    status = cluster.app()
    if status.get("deployed_app_config", {}).get("args", {}).get("model") != model:
        return None
    return status if status.get("status") == "DEPLOY_FAILED" else None


def test_rolling_upgrades_under_load_fail_no_request(cluster, app, smollm2_llm, tmp_path):
    (expected,) = smollm2_llm.generate([FRANCE], SamplingParams(max_tokens=8, temperature=0))
    v1 = app.config
    v2 = json.loads(json.dumps(v1))
    v2["applications"][0]["args"]["max_num_seqs"] = 32
    broken_file = tmp_path / "broken.gguf"
    broken_file.write_bytes(b"not a gguf file" * 64)   # exists (the app builds), cannot load
    clients = Clients(app.base)
    try:
        clients.wait_for_more(4)
        steps = []
        before = replica_ids(cluster.app())
        cluster.deploy(v2, "v2")                                   # a good change: replicas replaced
        upgraded = wait_for("the changed config", lambda: running(cluster, v2, before), 600, interval_s=1)
        clients.wait_for_more(4)
        steps.append(len(clients.results))
        for model in ("/no/such/model.gguf", str(broken_file)):   # never takes traffic; v2 keeps serving
            broken = json.loads(json.dumps(v2))
            broken["applications"][0]["args"]["model"] = model
            cluster.deploy(broken, "broken")
            wait_for(f"deploy of {model} to fail", lambda: failed_deploy(cluster, model), 300, interval_s=1)
            clients.wait_for_more(4)
            steps.append(len(clients.results))
        cluster.deploy(v2, "v2-again")                            # the good one again: still the same replicas
        again = wait_for("the changed config again", lambda: running(cluster, v2), 300, interval_s=1)
        assert replica_ids(again) == replica_ids(upgraded)
        clients.wait_for_more(4)
    finally:
        results = clients.stop()
    failures = [text for ok, _, text in results if not ok]
    assert not failures, f"{len(failures)} of {len(results)} requests failed: {failures[:3]}"
    answers = {kind: {text for _, k, text in results if k == kind} for kind in ("chat", "long")}
    assert answers == {"chat": {expected.text},     # every answer from a healthy version
                       "long": {f"length {LONG_TOKENS}"}}   # and no stream cut short
    print(f"rolling upgrades: {len(results)} requests, 0 failed (after each step: {steps})")
