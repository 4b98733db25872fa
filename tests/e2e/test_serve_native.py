"""Issue 28 on a real Ray Serve app: one ``ModelReplica`` deployment of two replicas (a tiny
Llama checkpoint, TP=1), the router's prefix-aware routing with its load guard, the one gRPC
endpoint (official stubs, API key, health, reflection) and vLLM's metric names in ``/metrics``.

One app per module (started once, shared by every case); its replicas report their prefix-cache
hits per request (``usage.cached_tokens``), which is the oracle of the routing test.
"""

from __future__ import annotations

import json
import sys
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc
from procs import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_checkpoints import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.ray]

APP = "native"
KEY = "sk-native-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
VOCAB = 96                      # write_tiny_llama's vocabulary (0: bos, 1: eos)
PREFIX_TOKENS, NUM_PREFIXES, ROUNDS = 500, 8, 4
LOAD_MARGIN = 4                 # requests the cached replica may have beyond the least-loaded one


@dataclass
class App:
    base: str
    grpc_address: str
    checkpoint: str
    hit_rates: dict = field(default_factory=dict)   # routing policy -> hit rate measured

    def http(self, method: str, path: str, body: dict | None = None, key: str | None = KEY):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()


def args(checkpoint: str, routing: str) -> dict:
    return {"model": checkpoint, "tensor_parallel_size": 1, "data_parallel_size": 2, "cpus_per_worker": 0.5,
            "router_cpus": 0.5, "num_blocks": 512, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 32,
            "dtype": "float32", "grpc_host": "127.0.0.1", "grpc_port": 0, "api_key": KEY, "routing": routing,
            "routing_load_margin": LOAD_MARGIN, "request_timeout": 120}


@pytest.fixture(scope="module")
def app(ray_cluster, tmp_path_factory):
    from ray import serve

    from shardserve.cluster.serve_app import build_app

    checkpoint = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(checkpoint, tokenizer=True, max_position_embeddings=1024)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args(str(checkpoint), "prefix-aware")), name=APP, route_prefix="/")
        address = serve.get_app_handle(APP).grpc_address.remote().result(timeout_s=60)
        yield App(f"http://127.0.0.1:{port}", address, str(checkpoint))
    finally:
        serve.shutdown()


def generate(stub, ids: list[int], max_tokens: int = 1, metadata=AUTH) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return list(stub.Generate(request, metadata=metadata, timeout=120))


def prefix_workload(seed: int) -> list[tuple[int, list[int]]]:
    """``NUM_PREFIXES`` prompts of a ``PREFIX_TOKENS``-token shared prefix plus a distinct question,
    each prefix ``ROUNDS`` times, interleaved: ``[(prefix index, token ids)]``."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(NUM_PREFIXES)]
    return [(p, prefixes[p] + [rng.randrange(2, VOCAB) for _ in range(12)])
            for _ in range(ROUNDS) for p in range(NUM_PREFIXES)]


def hit_rate(stub, workload, concurrency: int = 4) -> float:
    """Prompt tokens served from the prefix cache over all prompt tokens, for every request after
    the first of its prefix (the first ones run before the others start)."""
    first, rest = workload[:NUM_PREFIXES], workload[NUM_PREFIXES:]
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda item: generate(stub, item[1]), first))
        answers = list(pool.map(lambda item: generate(stub, item[1]), rest))
    prompt = sum(a[-1].usage.prompt_tokens for a in answers)
    cached = sum(a[-1].usage.cached_tokens for a in answers)
    return cached / prompt


def metric_samples(app: App) -> dict[tuple, float]:
    """``{(name, sorted labels): value}`` of ``/metrics``, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    _, raw = app.http("GET", "/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(raw.decode()) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lbl), v in samples.items()
               if n == name and all(dict(lbl).get(k) == val for k, val in labels.items()))


def test_prefix_aware_routing_hits_the_cache_and_the_load_guard_spreads_one_hot_prefix(app):
    channel = grpc.insecure_channel(app.grpc_address)
    stub = pb_grpc.InferenceStub(channel)
    aware = hit_rate(stub, prefix_workload(seed=1))
    before = metric_samples(app)
    hot = prefix_workload(seed=2)[0][1]
    with ThreadPoolExecutor(32) as pool:   # 32 concurrent requests sharing one prefix
        list(pool.map(lambda i: generate(stub, hot + [2 + i % 90], max_tokens=16), range(32)))
    after = metric_samples(app)
    routed = {dict(lbl)["replica"]: v - before.get((n, lbl), 0.0)
              for (n, lbl), v in after.items() if n == "shardserve_requests_routed_total"}
    guarded = (total(after, "shardserve_routing_decisions_total", reason="load_guard")
               - total(before, "shardserve_routing_decisions_total", reason="load_guard"))
    print(f"prefix-aware: {aware:.1%} of the prompt tokens after each prefix's first request were cache hits; "
          f"one hot prefix x 32 concurrent: routed {sorted(routed.values())}, {guarded:.0f} load-guard decisions")
    assert aware >= 0.70
    assert len(routed) == 2 and min(routed.values()) > 0, routed   # both replicas served the hot prefix
    assert guarded > 0
    channel.close()
    app.hit_rates["prefix-aware"] = aware


def test_one_grpc_endpoint_with_key_health_and_reflection(app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(app.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        answer = generate(stub, [5, 6, 7, 8], max_tokens=6)
        assert sum(len(r.token_ids) for r in answer) == 6 and answer[-1].finish_reason == "length"
        assert "".join(r.text for r in answer).strip()
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, [5, 6, 7], metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        rejected = total(metric_samples(app), "shardserve_requests_total", endpoint="grpc", status="400")
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [5, VOCAB + 3])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert total(metric_samples(app), "shardserve_requests_total", endpoint="grpc", status="400",
                     outcome="rejected") == rejected + 1
        info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=30)
        assert info.vocab_size == VOCAB and info.block_size == 16
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:   # like every method but health: the key first
            list(reflection.ServerReflectionInfo(iter([ask]), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        (reply,) = reflection.ServerReflectionInfo(iter([ask]), metadata=AUTH, timeout=30)
        services = {s.name for s in reply.list_services_response.service}
        assert {"shardserve.v1.Inference", "grpc.health.v1.Health"} <= services


def test_clients_may_reuse_a_request_id_and_each_call_keeps_its_own_answer(app):
    """Two calls with the same ``request_id`` at once, one of them leaving mid-stream, do not share
    a stream on the replica: the router gives each call an id of its own and answers with the caller's."""
    def ask(stub, ids):
        request = pb.GenerateRequest(request_id="same-id", token_ids=pb.TokenIds(ids=ids),
                                     sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        return stub.Generate(request, metadata=AUTH, timeout=120)

    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]   # 6 calls on 2 replicas: some share a replica
    with grpc.insecure_channel(app.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        alone = [[t for r in generate(stub, ids, max_tokens=8) for t in r.token_ids] for ids in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda ids: list(ask(stub, ids)), prompts))
        assert [[t for r in answer for t in r.token_ids] for answer in together] == alone
        assert {r.request_id for answer in together for r in answer} == {"same-id"}
        leaving = ask(stub, prompts[0])
        next(leaving)
        staying = [ask(stub, ids) for ids in prompts[1:]]
        leaving.cancel()
        assert [[t for r in call for t in r.token_ids] for call in staying] == alone[1:]


VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
              "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
              "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
              "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count")


def test_metrics_carry_vllm_names_per_replica_that_move_with_the_load(app):
    before = metric_samples(app)
    body = {"prompt": [[3 + i % 90 for i in range(40)]], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for _ in range(3):
        status, raw = app.http("POST", "/v1/completions", body)
        assert status == 200, raw
    after = metric_samples(app)
    for name in VLLM_NAMES:
        series = [dict(lbl) for n, lbl in after if n == name]
        assert series and all(s.get("model_name") for s in series), name
    replicas = {dict(lbl)["replica"] for n, lbl in after if n == "vllm:num_requests_running"}
    assert len(replicas) == 2
    moved = {name: total(after, name) - total(before, name)
             for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                          "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                          "vllm:request_queue_time_seconds_count", "vllm:request_inference_time_seconds_count")}
    assert moved == {"vllm:prompt_tokens_total": 120, "vllm:generation_tokens_total": 15,
                     "vllm:e2e_request_latency_seconds_count": 3, "vllm:time_to_first_token_seconds_count": 3,
                     "vllm:request_queue_time_seconds_count": 3, "vllm:request_inference_time_seconds_count": 3}
    spent = {name: total(after, name) - total(before, name)
             for name in ("vllm:e2e_request_latency_seconds_sum", "vllm:time_to_first_token_seconds_sum",
                          "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
                          "vllm:request_decode_time_seconds_sum", "vllm:request_inference_time_seconds_sum")}
    # the replica's phases nest inside what the router saw: queue + prefill within TTFT, all within e2e
    assert 0 < spent["vllm:request_prefill_time_seconds_sum"]
    assert (spent["vllm:request_queue_time_seconds_sum"] + spent["vllm:request_prefill_time_seconds_sum"]
            <= spent["vllm:time_to_first_token_seconds_sum"])
    assert spent["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        spent["vllm:request_prefill_time_seconds_sum"] + spent["vllm:request_decode_time_seconds_sum"])
    assert spent["vllm:request_inference_time_seconds_sum"] <= spent["vllm:e2e_request_latency_seconds_sum"]


@pytest.mark.extended
def test_least_loaded_figure_for_comparison(app):
    """The same workload (other prefixes) routed least-loaded, for the figure beside prefix-aware's.
    Redeploys the app (``serve.run`` starts new replicas), so it runs last in this module."""
    from ray import serve

    from shardserve.cluster.serve_app import build_app

    serve.run(build_app(args(app.checkpoint, "least-loaded")), name=APP, route_prefix="/")
    app.grpc_address = serve.get_app_handle(APP).grpc_address.remote().result(timeout_s=60)
    with grpc.insecure_channel(app.grpc_address) as channel:
        least = hit_rate(pb_grpc.InferenceStub(channel), prefix_workload(seed=3))
    aware = app.hit_rates.get("prefix-aware")
    print(f"least-loaded: {least:.1%} of the prompt tokens after each prefix's first request were cache hits "
          f"(prefix-aware: {'not run' if aware is None else f'{aware:.1%}'})")
    assert aware is None or aware > least
