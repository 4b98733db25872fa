"""Issue 28: Serve autoscales the one ``ModelReplica`` deployment (``min_replicas=1``,
``max_replicas=2``) on the requests the replicas hold: under a steady load a second replica starts
and serves, and after the load the app returns to one replica, the stopping one draining, without
a failed request. Minutes on a loaded 2-core machine: extended (``make test-all``)."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from procs import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.extended]

APP = "autoscale"


def running_replicas(serve) -> int:
    deployment = serve.status().applications[APP].deployments["ModelReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def routed_per_replica(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "shardserve_requests_routed_total"}


class Load:
    """``clients`` threads sending completions back to back until stopped; every answer is
    checked (200, all ``max_tokens`` tokens)."""

    def __init__(self, base: str, clients: int, max_tokens: int) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.ok, self.failures = 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: int) -> None:
        sent = 0
        while not self._stop.is_set():
            sent += 1   # a new prompt each time: no cached prefix draws it to one replica
            body = {"prompt": [[2 + (client * 31 + sent * 7 + i * i) % 94 for i in range(24)]],
                    "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(self.base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    answer = json.loads(resp.read())
                assert answer["usage"]["completion_tokens"] == self.max_tokens, answer
                self.ok += 1
            except (urllib.error.URLError, AssertionError, OSError) as exc:
                self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_scales_to_two_replicas_under_load_and_back_to_one_without_a_failed_request(ray_cluster, tmp_path):
    from ray import serve

    from shardserve.cluster.serve_app import build_app

    write_tiny_llama(tmp_path, tokenizer=True, max_position_embeddings=512)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": str(tmp_path), "tensor_parallel_size": 1, "cpus_per_worker": 0.5,
                             "router_cpus": 0.5, "num_blocks": 256, "max_model_len": 512, "dtype": "float32",
                             "grpc_port": None, "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                             "upscale_delay_s": 2, "downscale_delay_s": 5, "autoscaling_look_back_s": 12,
                             "drain_timeout_s": 60}), name=APP, route_prefix="/")
        assert running_replicas(serve) == 1
        started = time.monotonic()
        load = Load(base, clients=6, max_tokens=96)
        try:
            wait_for(lambda: running_replicas(serve) == 2, 300, "a second replica")
            up_s = time.monotonic() - started
            wait_for(lambda: len([v for v in routed_per_replica(base).values() if v >= 5]) == 2, 120,
                     "both replicas to serve")
        finally:
            load.stop()
        heavy_ok = load.ok
        # One light client while the app scales down: the stopping replica drains, nothing fails.
        light = Load(base, clients=1, max_tokens=32)
        try:
            wait_for(lambda: running_replicas(serve) == 1, 300, "the return to one replica")
            down_s = time.monotonic() - started - up_s
            before = light.ok
            wait_for(lambda: light.ok >= before + 3, 120, "requests after the scale-down")
            # the stopped replica's series left /metrics with it
            wait_for(lambda: len(routed_per_replica(base)) == 1, 60, "one replica's series")
        finally:
            light.stop()
        print(f"scaled up after {up_s:.1f} s under 6 clients ({heavy_ok} requests), back to 1 replica "
              f"{down_s:.1f} s later ({light.ok} light requests); routed per replica: {routed_per_replica(base)}")
        assert load.failures == [] and light.failures == [], load.failures + light.failures
    finally:
        serve.shutdown()
