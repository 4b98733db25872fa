"""The front door of a real ``shardserve serve`` (its own Ray cluster, 2 replicas of TP=1, one
sequence and one waiting request per replica) started with inference keys and an admin key (from
files), a per-key rate limit, HTTPS and gRPC over TLS: every route needs a key but ``GET /health``,
every gRPC method but health's, the admin routes and ``ReloadWeights`` the admin key only, reloads
stay in the allowed root without telling what exists outside it, refused requests do no work
(413 / 400 / 429 before any token), full queues answer 429 after the other replica was tried,
deadlines free every block, hostile bodies never get a 5xx, tenants never share prefix blocks, a
4 MB ``Tokenize`` does not stall decoding, and the official clients work over TLS.

The fuzz, the HTTP deadline and the never-reading client also run in this process through the same
app builder Serve runs (:func:`cluster.frontend.openai_app.build_openai_app`), wired to this server's
real replicas over gRPC/TLS with the admin key (a privileged caller, as the router's internal token
is): fast, and every body that passes validation reaches a real engine."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import signal
import socket
import statistics
import ssl
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from certs import self_signed_certificate
from procs import BIN, free_port, stop_process_group, subprocess_env, wait_for
from shardserve.cluster.frontend.limits import Limits
from shardserve.cluster.frontend.openai_app import build_openai_app
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.security import FrontConfig, key_digest, key_id
from shardserve.proto import inference_pb2 as pb
from shardserve.proto import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "smollm2-135m-instruct"
KEY = "sk-front-door-test"
KEY2 = "sk-front-door-second-tenant"
KEY3 = "sk-front-door-rate-limited"      # only the rate-limit test uses it
ADMIN = "sk-front-door-admin"
AUTH = (("authorization", f"Bearer {KEY}"),)
RATE_LIMIT = 120                         # requests per minute and key (--rate-limit)
MAX_PROMPT_CHARS = 4_500_000             # a 4 MB Tokenize fits; 4.6 M characters do not
BAD_AUTH = [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}]   # none, wrong, no "Bearer"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"   # greedy: counts on, never stops by itself


@dataclass
class Front:
    proc: subprocess.Popen
    port: int
    grpc_addresses: list[str]   # each replica's own gRPC server (direct access), from /admin/status
    replica_ids: list[str]      # Serve's id of each of those replicas (the ``replica`` label of /metrics)
    grpc_endpoint: str          # the app's one gRPC endpoint (--grpc-port, the router's)
    cert: Path
    key_file: Path
    context: ssl.SSLContext
    logs: Path                  # Ray's log folder of the server's cluster
    stdout: list[str]           # the server's stdout lines so far

    def request(self, method: str, path: str, headers: dict | None = None, body: bytes | None = None,
                timeout: float = 120) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        _, _, raw = self.request("GET", "/metrics", {"Authorization": f"Bearer {KEY}"})
        return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in raw.decode().splitlines()
                                                       if line.startswith("shardserve_"))}

    def channel(self, replica: int = 0) -> grpc.Channel:
        return grpc.secure_channel(self.grpc_addresses[replica], grpc.ssl_channel_credentials(self.cert.read_bytes()))

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"https://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0,
                             timeout=120, http_client=openai.DefaultHttpxClient(verify=self.context))


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front")
    cert, key = self_signed_certificate(folder)
    port, grpc_port = free_port(), free_port()
    log = open(folder / "stderr.log", "w")
    (folder / "keys").write_text(f"{KEY}\n{KEY2}\n{KEY3}\n")
    (folder / "admin").write_text(f"{ADMIN}\n")
    proc = subprocess.Popen(
        [str(BIN / "shardserve"), "serve", MODEL, "-tp", "1", "-dp", "2", "--cpus-per-worker", "1",
         "--kv-cache-gib", "0.05", "--max-model-len", "1024", "--max-num-seqs", "1", "--max-queued-requests", "1",
         "--api-key-file", str(folder / "keys"), "--admin-api-key-file", str(folder / "admin"),
         "--rate-limit", str(RATE_LIMIT), "--max-prompt-chars", str(MAX_PROMPT_CHARS),
         "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--grpc-tls-cert", str(cert),
         "--grpc-tls-key", str(key), "--port", str(port), "--grpc-port", str(grpc_port)],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        wait_for("the URLs", lambda: any("Press Ctrl-C to stop." in line for line in lines), 400,
                 alive=lambda: proc.poll() is None)
        out = "".join(lines)
        assert f"https://127.0.0.1:{port}/v1" in out and "Application" not in out, out   # no early "is ready"
        assert "context:    1024 tokens per sequence, prompt + output (--max-model-len)" in out, out
        logs = Path(re.search(r"\(logs: (\S+)\)", out).group(1))
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
        conn.request("GET", "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})
        replicas = json.loads(conn.getresponse().read())["replicas"]
        conn.close()
        replicas.sort(key=lambda r: r["address"])
        addresses = [r["address"] for r in replicas]
        assert len(addresses) == 2 and f"127.0.0.1:{grpc_port}" not in addresses, addresses
        yield Front(proc, port, addresses, [r["id"] for r in replicas], f"127.0.0.1:{grpc_port}", cert, key, context,
                    logs, lines)
    finally:
        stop_process_group(proc, signal.SIGINT, 60)
        log.close()


def all_routes(front: Front) -> list[tuple[str, str]]:
    """(method, path) of every route the app exposes, from the app's own route list (the builder
    Serve runs) and the server's ``/openapi.json``, plus paths that match no route."""
    core = RouterCore(MODEL, [MODEL], [], load_tokenizer=lambda: None, front=FrontConfig.from_keys([KEY], [ADMIN]))
    routes = {(method, route.path) for route in build_openai_app(core).routes for method in route.methods}
    status, _, raw = front.request("GET", "/openapi.json", {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    routes |= {(method.upper(), path) for path, ops in json.loads(raw)["paths"].items() for method in ops}
    # NOTE: Ray Serve's proxy answers /-/healthz and /-/routes itself, before any app (KubeRay's
    # probes use them); they are not routes of this app and carry no model output.
    routes |= {("GET", "/no/such/route"), ("POST", "/v1/chat/completion"), ("GET", "/v1/chat/completions"),
               ("POST", "/admin/anything"), ("GET", "/-/anything")}
    return sorted((method, path.replace("{model}", MODEL)) for method, path in routes)


def valid_body(path: str) -> bytes | None:
    """A body that would generate tokens if it got through."""
    if path.endswith("/chat/completions"):
        return json.dumps({"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 8}).encode()
    if path.endswith("/completions"):
        return json.dumps({"prompt": COUNT, "max_tokens": 8}).encode()
    return None


def test_every_route_needs_the_key_except_health_and_refused_requests_do_no_work(front):
    routes = all_routes(front)
    assert ("POST", "/v1/completions") in routes and ("GET", "/metrics") in routes and ("GET", "/docs") in routes
    before = front.metrics()
    for method, path in routes:
        for headers in BAD_AUTH:
            status, resp_headers, raw = front.request(method, path, headers, valid_body(path))
            if path == "/health":   # open to GET and HEAD (load balancers probe with either)
                assert status == 200 and (method == "HEAD" or json.loads(raw)["status"] == "ok"), (method, status)
                continue
            assert status == 401, (method, path, headers, status)
            assert resp_headers["www-authenticate"] == "Bearer"
            if method != "HEAD":
                error = json.loads(raw)["error"]
                assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key"), error
                assert KEY not in raw.decode()
    after = front.metrics()
    for name in ("shardserve_generation_tokens_total", "shardserve_prompt_tokens_total"):
        assert after[name] == before.get(name, 0.0), name
    assert not any(k.startswith("shardserve_requests_total") and v != before.get(k) for k, v in after.items())
    for method, path in routes:   # with the key: through the guard (errors of their own are fine)
        body = b"{}" if method == "POST" else None
        if path == "/admin/reload_weights":   # a bad mode: the route's own 400, no reload of both replicas
            body = b'{"mode": "bogus"}'
        status, _, _ = front.request(method, path, {"Authorization": f"Bearer {KEY}"}, body)
        assert status != 401, (method, path)


def test_grpc_needs_the_key_except_health_and_tls_round_trips(front):
    calls = {"Generate": lambda stub, md: list(stub.Generate(
                 pb.GenerateRequest(text=COUNT, sampling=pb.SamplingParams(max_tokens=4, temperature=0)),  # greedy,
                 metadata=md, timeout=60)),                                       # as the HTTPS call compared below
             "Tokenize": lambda stub, md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=60),
             "ModelInfo": lambda stub, md: stub.ModelInfo(pb.ModelInfoRequest(), metadata=md, timeout=60),
             "ReloadWeights": lambda stub, md: stub.ReloadWeights(pb.ReloadWeightsRequest(), metadata=md, timeout=60)}
    with front.channel(0) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for name, call in calls.items():
            for md in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", KEY),)):
                with pytest.raises(grpc.RpcError) as err:
                    call(stub, md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(reflect.ServerReflectionInfo(iter([ask]), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        (answer,) = reflect.ServerReflectionInfo(iter([ask]), metadata=AUTH, timeout=60)
        assert "shardserve.v1.Inference" in {s.name for s in answer.list_services_response.service}
        text = "".join(r.text for r in calls["Generate"](stub, AUTH))
    assert text.strip().startswith("11")
    answer = front.client().completions.create(model=MODEL, prompt=COUNT, max_tokens=4, temperature=0)
    assert answer.choices[0].text == text   # HTTPS through the router == gRPC/TLS to the replica


def test_https_round_trip_with_the_openai_client(front):
    client = front.client()
    card = client.models.retrieve(MODEL)
    listed = client.models.list()
    assert card.id == MODEL and [m.id for m in listed.data] == [MODEL]
    assert time.time() - 3600 < card.created <= time.time()
    with pytest.raises(openai.AuthenticationError):
        front.client("sk-wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError) as err:   # the prompt fits, max_tokens does not
        client.completions.create(model=MODEL, prompt=COUNT, max_tokens=1020)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"


# -- issue 27: roles, limits before work, tenants --------------------------------------------------

def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_admin_routes_and_reload_take_the_admin_key_only_and_stay_in_the_allowed_root(front):
    assert front.request("GET", "/health")[2] == b'{"status":"ok"}'   # nothing more for the open route
    for headers, expected in (({}, 401), (bearer(KEY), 403), (bearer(ADMIN), 200)):
        status, _, raw = front.request("GET", "/admin/status", headers)
        assert status == expected, (headers, raw)
    details = json.loads(raw)   # the details /health no longer gives
    assert sorted(r["address"] for r in details["replicas"]) == sorted(front.grpc_addresses)
    assert ADMIN not in raw.decode() and KEY not in raw.decode()
    status, _, raw = front.request("POST", "/admin/reload_weights", bearer(KEY), b"{}")
    assert status == 403 and json.loads(raw)["error"]["code"] == "admin_key_required"
    # outside the allowed root (the served model's folder): the same answer whether the path exists or not
    answers = {}
    for path in ("/etc/passwd", "/etc/no-such-file-of-shardserve", "/root/.ssh"):
        status, _, raw = front.request("POST", "/admin/reload_weights", bearer(ADMIN), json.dumps({"model": path}).encode())
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "invalid_checkpoint", raw
        answers[path] = error["message"].replace(path, "PATH")
    assert len(set(answers.values())) == 1 and "allowed model root" in answers["/etc/passwd"], answers
    with front.channel(0) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for metadata, code in ((AUTH, grpc.StatusCode.PERMISSION_DENIED),
                               ((("authorization", f"Bearer {ADMIN}"),), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as err:
                stub.ReloadWeights(pb.ReloadWeightsRequest(model="/etc/passwd"), metadata=metadata, timeout=60)
            assert err.value.code() == code, err.value
        assert err.value.details().replace("/etc/passwd", "PATH") == answers["/etc/passwd"]
        info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=60)
        assert info.weights_version == 1 and info.prefix_cache_hit_tokens == 0   # counters: admin only


def test_limits_answer_413_400_and_429_before_any_token_is_computed(front):
    before = front.metrics()
    started = time.monotonic()
    cases = [(b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}', 413, "request_too_large"),      # 9 MiB body
             (json.dumps({"prompt": "y " * (MAX_PROMPT_CHARS // 2 + 50_000), "max_tokens": 1}).encode(), 400,
              "limit_exceeded"),                                                                    # characters
             (json.dumps({"prompt": ["a"] * 65, "max_tokens": 1}).encode(), 400, "limit_exceeded")]   # choices
    for body, status, code in cases:
        got, _, raw = front.request("POST", "/v1/completions", bearer(KEY), body)
        assert (got, json.loads(raw)["error"]["code"]) == (status, code), raw[:300]
    spent = 0   # KEY3's minute, spent on requests that fail their own way (the bucket refills meanwhile)
    while front.request("POST", "/v1/completions", bearer(KEY3), b"{not json")[0] == 400:
        spent += 1
        assert spent < 3 * RATE_LIMIT
    assert spent >= RATE_LIMIT
    # The bucket refills continuously (RATE_LIMIT / 60 per second), so the well-formed request right
    # after a 429 may find one refilled request (the limit working as meant): it then spends it, and
    # the next one, sent at once, cannot.
    admitted = 0
    for _ in range(3):
        got, headers, raw = front.request("POST", "/v1/completions", bearer(KEY3),
                                          json.dumps({"prompt": COUNT, "max_tokens": 1}).encode())
        if got != 200:
            break
        admitted += 1
    assert got == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
    got, _, _ = front.request("POST", "/v1/completions", bearer(KEY2), json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    assert got == 200   # the limit is per key
    print(f"HTTP 413/400/429 cases answered in {time.monotonic() - started:.1f} s")
    with front.channel(0) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for call, code in ((lambda: stub.Tokenize(pb.TokenizeRequest(text="z" * (9 * 1024 * 1024)), metadata=AUTH,
                                                  timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED),
                           (lambda: list(stub.Generate(pb.GenerateRequest(text="w " * (MAX_PROMPT_CHARS // 2 + 50_000)),
                                                       metadata=AUTH, timeout=60)), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == code, err.value
        limited = (("authorization", f"Bearer {KEY3}"),)   # the replica counts direct callers itself
        admitted_grpc = 0
        with pytest.raises(grpc.RpcError) as err:
            for _ in range(3 * RATE_LIMIT):
                stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=limited, timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # As over HTTP, the first Generate after the refusal may find one refilled request; the next,
        # sent at once, cannot (max_tokens: an admitted one ends at once instead of counting on).
        with pytest.raises(grpc.RpcError) as err:
            for _ in range(3):
                list(stub.Generate(pb.GenerateRequest(text=COUNT, sampling=pb.SamplingParams(max_tokens=1)),
                                   metadata=limited, timeout=60))
                admitted_grpc += 1
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--rate-limit" in err.value.details()
        assert admitted_grpc < 3
        info = stub.ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=60)
        assert info.num_running == 0 and info.num_waiting == 0
    after = front.metrics()
    for name in ("shardserve_prompt_tokens_total", "shardserve_generation_tokens_total"):   # KEY2's "hi" (+ refills)
        assert after[name] - before.get(name, 0.0) <= 3 + (admitted + admitted_grpc) * 64, (name, after[name])
    assert after.get(f'shardserve_key_generation_tokens_total{{key="{key_id(key_digest(KEY3))}"}}', 0) == admitted
    assert after[f'shardserve_rate_limited_total{{key="{key_id(key_digest(KEY3))}",limit="requests"}}'] == 2
    assert KEY3 not in json.dumps(after)   # ids, never keys


def test_admission_counts_a_request_once_whatever_its_choices(front):
    """One sequence and one waiting request per replica: a request of 3 choices still gets in (its
    calls are one request to the replica's admission), on one replica, without a queue-full refusal."""
    wait_idle(front)
    before = front.metrics()
    status, _, raw = front.request("POST", "/v1/completions", bearer(KEY),
                                   json.dumps({"prompt": COUNT, "n": 3, "max_tokens": 2, "temperature": 0}).encode())
    assert status == 200 and len(json.loads(raw)["choices"]) == 3, raw
    after = front.metrics()
    refusals = [k for k in after if k.startswith("shardserve_queue_full_rejections_total")]
    assert all(after[k] == before.get(k, 0) for k in refusals)


def test_an_overflowing_token_id_is_a_400_and_pays_its_routing_lease_back(front):
    """The verified 500 of issue 27: ``[[1099511627776]]`` raised after a replica was leased."""
    for prompt in ([[1099511627776]], [[-1]], [[49152]], [1, 2**31]):
        status, _, raw = front.request("POST", "/v1/completions", bearer(KEY),
                                       json.dumps({"prompt": prompt, "max_tokens": 4}).encode())
        assert status == 400 and "token ids must be in [0, 49152)" in json.loads(raw)["error"]["message"], raw
    _, _, raw = front.request("GET", "/admin/status", bearer(ADMIN))
    assert [r["outstanding_tokens"] for r in json.loads(raw)["replicas"]] == [0, 0]


def generate_usage(channel, text: str, metadata, cache_salt: str = "") -> pb.Usage:
    responses = list(pb_grpc.InferenceStub(channel).Generate(
        pb.GenerateRequest(text=text, cache_salt=cache_salt, sampling=pb.SamplingParams(max_tokens=1, temperature=0)),
        metadata=metadata, timeout=120))
    return responses[-1].usage


def test_tenants_never_share_prefix_blocks(front):
    """Prefix-cache hashes are salted per key (and per ``cache_salt``): a key's repeat hits, another
    key's identical prompt does not, on the replica directly and through the router."""
    key2 = (("authorization", f"Bearer {KEY2}"),)
    first = " ".join(f"tenant probe word {i}" for i in range(20))    # > 4 full blocks of 16 tokens
    with front.channel(0) as channel:
        assert generate_usage(channel, first, AUTH).cached_tokens == 0
        again = generate_usage(channel, first, AUTH)
        assert again.cached_tokens >= 48, again                        # the same key: a hit
        assert generate_usage(channel, first, key2).cached_tokens == 0    # another key: none
        assert generate_usage(channel, first, AUTH, cache_salt="mine").cached_tokens == 0
    second = " ".join(f"router probe word {i}" for i in range(20))
    for replica in range(2):   # KEY's blocks of the prompt on both replicas
        with front.channel(replica) as channel:
            generate_usage(channel, second, AUTH)
    body = json.dumps({"prompt": second, "max_tokens": 1}).encode()
    for key in (KEY2, KEY):
        assert front.request("POST", "/v1/completions", bearer(key), body)[0] == 200
    _, _, raw = front.request("GET", "/admin/status", bearer(ADMIN))
    hits = json.loads(raw)["prefix_cache_hit_tokens_by_key"]
    assert hits.get(key_id(key_digest(KEY2)), 0) == 0 and hits[key_id(key_digest(KEY))] >= 48, hits


def long_stream(channel: grpc.Channel, max_tokens: int = 900):
    """A direct gRPC call that keeps a replica busy until cancelled (900 tokens: tens of seconds
    even at llama.cpp speeds; with a 20-token prompt it fits --max-model-len 1024)."""
    return pb_grpc.InferenceStub(channel).Generate(
        pb.GenerateRequest(text=COUNT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0)),
        metadata=AUTH, timeout=300)


def replica_info(front: Front, replica: int) -> pb.ModelInfoResponse:
    with front.channel(replica) as channel:
        return pb_grpc.InferenceStub(channel).ModelInfo(pb.ModelInfoRequest(), metadata=AUTH, timeout=60)


def fill(front: Front, replica: int, channel: grpc.Channel) -> list:
    """Make ``replica`` full (one running, one waiting: ``--max-num-seqs 1 --max-queued-requests 1``)
    with two long streams. The second starts only once the first runs: sent together, the second
    could find the first still waiting and be refused itself."""
    calls = [long_stream(channel)]
    wait_for(f"replica {replica} running", lambda: replica_info(front, replica).num_running == 1, 60)
    calls.append(long_stream(channel))
    wait_for(f"replica {replica} full", lambda: replica_info(front, replica).num_waiting == 1, 60)
    return calls


def wait_idle(front: Front, timeout_s: float = 60) -> None:
    """Every replica has no running or waiting request and all its KV blocks free."""
    def idle():
        infos = [replica_info(front, i) for i in range(2)]
        return all(i.num_running == 0 and i.num_waiting == 0 and i.num_free_blocks == i.num_blocks for i in infos)
    wait_for("all replicas idle with every block free", idle, timeout_s)


def test_a_full_replica_is_skipped_for_the_other_one_then_all_full_answers_429(front):
    wait_idle(front)
    channel = front.channel(0)
    busy = []
    try:
        busy += fill(front, 0, channel)
        before = front.metrics()
        for i in range(2):   # no prefix cached anywhere: routing takes turns, one of these tries replica 0 first
            body = json.dumps({"prompt": f"Request {i} of the full-replica test. {COUNT}", "max_tokens": 4,
                               "temperature": 0}).encode()
            status, _, raw = front.request("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}, body)
            assert status == 200, raw
        after = front.metrics()
        delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        full, other = front.replica_ids
        assert delta[f'shardserve_requests_routed_total{{replica="{other}"}}'] == 2
        assert delta.get(f'shardserve_queue_full_rejections_total{{replica="{full}"}}', 0) >= 1
    finally:
        for call in busy:
            call.cancel()
        channel.close()
    wait_idle(front)
    channels = [front.channel(0), front.channel(1)]
    busy = []
    try:
        for replica, channel in enumerate(channels):
            busy += fill(front, replica, channel)
        body = json.dumps({"prompt": COUNT, "max_tokens": 4, "temperature": 0}).encode()

        def one(_):
            status, headers, raw = front.request("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}, body)
            return status, headers, json.loads(raw)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(4)))
        for status, headers, answer in results:   # refused at once, while the long streams still run
            assert status == 429 and headers["retry-after"] == "1", (status, answer)
            assert answer["error"]["code"] == "rate_limit_exceeded", answer
    finally:
        for call in busy:
            call.cancel()
        for channel in channels:
            channel.close()
    wait_idle(front)
    status, _, _ = front.request("GET", "/health")
    assert status == 200
    assert front.metrics()['shardserve_requests_total{endpoint="completions",outcome="rejected",status="429"}'] >= 4


def test_a_one_second_grpc_deadline_ends_a_500_token_request_and_frees_every_block(front):
    wait_idle(front)
    request = pb.GenerateRequest(text=COUNT, sampling=pb.SamplingParams(max_tokens=500, temperature=0))
    with front.channel(1) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in pb_grpc.InferenceStub(channel).Generate(request, metadata=AUTH, timeout=1):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 10
    wait_idle(front, timeout_s=15)   # the replica aborted it: every block is free again


def test_grpc_calls_that_end_before_the_first_token_are_counted_at_the_router(front):
    """The router's endpoint, a 1000-token prompt whose prefill outlasts the call: a 0.2 s deadline
    counts as a timeout, a client that cancels once the replica runs its prefill as cancelled (the
    router's handler is cancelled while it waits for the first token: that was counted nowhere, and
    a token charge was kept); the replica frees its blocks either way."""
    def counted(outcome: str, status: int) -> float:
        name = f'shardserve_requests_total{{endpoint="grpc",outcome="{outcome}",status="{status}"}}'
        return front.metrics().get(name, 0)

    ids = [100 + (i * 37) % 40000 for i in range(1000)]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=4))
    credentials = grpc.ssl_channel_credentials(front.cert.read_bytes())
    with grpc.secure_channel(front.grpc_endpoint, credentials) as channel:
        stub = pb_grpc.InferenceStub(channel)
        wait_idle(front)
        timeouts = counted("timeout", 408)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=AUTH, timeout=0.2))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for("the timeout counted", lambda: counted("timeout", 408) == timeouts + 1, 30)
        wait_idle(front, timeout_s=15)
        cancels = counted("cancelled", 499)
        call = stub.Generate(request, metadata=AUTH, timeout=60)
        wait_for("the prefill running", lambda: any(replica_info(front, i).num_running for i in range(2)), 30)
        call.cancel()
        wait_for("the cancel counted", lambda: counted("cancelled", 499) == cancels + 1, 30)
        wait_idle(front, timeout_s=15)


# -- the same app in this process, over this server's replicas ----------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_llm):
    return smollm2_llm.tokenizer   # cluster.tokenizer.load_tokenizer on the same file, loaded once per session


def local_app_scenario(front: Front, tokenizer, scenario, request_timeout: float | None = None,
                       limits: Limits | None = None, raw: bool = False):
    """Run ``scenario(client)`` (``raw``: ``scenario(app, core)``) against an in-process app (the
    builder Serve runs) whose router core reaches this server's real replicas over gRPC/TLS."""
    import httpx2

    infos = [replica_info(front, i) for i in range(2)]
    fields = ("max_model_len", "num_blocks", "num_free_blocks", "healthy", "vocab_size")
    # The admin key stands in for the internal token the real router gets from each replica.
    statuses = [{"state": "ready", "address": address, "error": None, "token": ADMIN,
                 "info": {name: getattr(info, name) for name in fields}}
                for address, info in zip(front.grpc_addresses, infos)]

    def fetcher(status):
        async def fetch():
            return status
        return fetch

    front_config = FrontConfig.from_keys([KEY], [ADMIN], request_timeout=request_timeout, limits=limits or Limits(),
                                         grpc_tls_cert=str(front.cert), grpc_tls_key=str(front.key_file))

    async def run():
        core = RouterCore(MODEL, [MODEL], [fetcher(s) for s in statuses], lambda: tokenizer, front=front_config)
        core.start()
        app = build_openai_app(core)
        try:
            while core.tokenizer is None or len(core.pool.ready()) < 2:
                await asyncio.sleep(0.05)
            if raw:
                return await scenario(app, core)
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://app", timeout=120,
                                          headers={"Authorization": f"Bearer {KEY}"}) as client:
                return await scenario(client)
        finally:
            await core.close()

    return asyncio.run(run())


def test_request_timeout_answers_408_or_ends_the_stream_and_frees_every_block(front, tokenizer):
    wait_idle(front)
    body = {"prompt": COUNT, "max_tokens": 500, "temperature": 0}

    async def scenario(client):
        plain = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json=dict(body, stream=True))
        return plain, streamed

    started = time.monotonic()
    plain, streamed = local_app_scenario(front, tokenizer, scenario, request_timeout=2.0)
    print(f"two 2-second deadlines answered after {time.monotonic() - started:.1f} s (loaded machine)")
    assert plain.status_code == 408 and plain.json()["error"]["code"] == "request_timeout", plain.text
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout" and len(events) > 2   # tokens came first
    wait_idle(front, timeout_s=15)


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_blocks_freed(front, tokenizer):
    """The stream keeps at most ``sse_buffer_events`` unread events; past them the request is aborted
    (the replica frees its blocks) instead of its output piling up. The client here is an ASGI
    ``send`` that never returns after the first body chunk, as with a socket nobody reads."""
    wait_idle(front)
    body = json.dumps({"prompt": COUNT, "max_tokens": 500, "temperature": 0, "stream": True}).encode()

    async def scenario(app, core):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")],
                 "scheme": "http", "server": ("app", 80), "client": ("c", 1), "http_version": "1.1"}
        sent, stuck, bodies = [], asyncio.Event(), [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():   # the body, then nothing: the client neither reads nor leaves
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                stuck.set()
                await asyncio.Event().wait()   # never returns: the client does not read

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(stuck.wait(), 120)
        dropped = 'outcome="dropped"'
        deadline = time.monotonic() + 60
        while dropped not in core.metrics.render().decode() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        dropped_at = time.monotonic()
        await asyncio.to_thread(wait_idle, front, 30)   # the replicas freed every block
        freed_at = time.monotonic()
        task.cancel()
        return dropped in core.metrics.render().decode(), freed_at - dropped_at, core.pool.replicas

    was_dropped, free_s, replicas = local_app_scenario(front, tokenizer, scenario, raw=True,
                                                       limits=Limits(sse_buffer_events=8))
    print(f"never-reading client dropped; every block free {free_s:.1f} s later")
    assert was_dropped and all(r.outstanding_tokens == 0 for r in replicas)


def hostile_bodies(rng: random.Random, count: int = 600) -> list[tuple[str, bytes]]:
    """``count`` ``(path, body)`` pairs drawn from every class: wrong types, extreme numbers, huge
    strings, broken JSON and lone surrogates, each in one field of an otherwise valid (and cheap:
    one token) request of that endpoint."""
    base_chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    base_text = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    wrong_types = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [1], {"a": 1}, [[]], ["a", 1]]
    extreme = [2**31, 2**63, 2**64, -(2**63) - 1, 10**400, 1e308, -1e308, 5e-324, float("inf"), float("nan"), -0.0]
    huge = ["x" * 1_000_000, "\U0001F600" * 200_000, "a\x00b" * 1000]
    surrogates = ["\ud800", "a\udfff", "\udbff\udc00\ud800 x"]
    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "stream",
              "logprobs", "user", "stream_options", "max_completion_tokens", "top_logprobs", "extra_field"]
    bodies = []
    for path, base, text_field in (("/v1/chat/completions", base_chat, "messages"),
                                   ("/v1/completions", base_text, "prompt")):
        one_kind = []
        for field in fields + [text_field]:
            for value in wrong_types + extreme + huge[:1] + surrogates:
                if field in ("max_tokens", "max_completion_tokens", "n") and value is None:
                    continue   # chat without max_tokens runs to the context limit: valid, but slow
                one_kind.append(json.dumps(dict(base, **{field: value})).encode())
        for value in huge[1:] + surrogates:
            content = [{"role": "user", "content": value}] if text_field == "messages" else value
            one_kind.append(json.dumps(dict(base, **{text_field: content})).encode())
        raw = json.dumps(base).encode()
        one_kind += [raw[:cut] for cut in rng.sample(range(1, len(raw)), 8)]                  # truncated
        one_kind += [raw + b"}", b"{" + raw, raw.replace(b":", b"=", 1), b"\xff\xfe" + raw, b"", b"null",
                     b"[]", b'"text"', b"1e999999", b"[" * 50_000 + b"]" * 50_000,
                     b'{"a": ' * 2000 + b"1" + b"}" * 2000, raw.replace(b"Hi", b"\\ud800"),
                     raw.replace(b'"Hi"', b'"\\udc00\\ud800"')]
        bodies += [(path, body) for body in one_kind]
    return rng.sample(bodies, count)


def test_hostile_bodies_never_get_a_5xx(front, tokenizer):
    wait_idle(front)
    bodies = hostile_bodies(random.Random(0))

    async def scenario(client):
        seen = []
        for path, body in bodies:
            resp = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            seen.append((resp.status_code, resp.headers.get("content-type", ""), path, body[:80]))
        return seen

    started = time.monotonic()
    seen = local_app_scenario(front, tokenizer, scenario)
    statuses = sorted({status for status, *_ in seen})
    print(f"{len(seen)} hostile bodies in {time.monotonic() - started:.1f} s (loaded machine); statuses {statuses}")
    server_errors = [s for s in seen if s[0] >= 500]
    assert not server_errors, server_errors[:5]
    assert all(content_type.startswith(("application/json", "text/event-stream")) for _, content_type, _, _ in seen)
    assert sum(status == 200 for status, *_ in seen) >= 20 and sum(status == 400 for status, *_ in seen) >= 400
    for body in (b'{"prompt": "\\ud800 x", "max_tokens": 2}', b'{"messages": [{"role": "user", "content": '
                 b'"\\udfff"}]}', b"[" * 100_000, b'{"prompt": ' + json.dumps("y" * 2_000_000).encode() + b"}"):
        for path in ("/v1/completions", "/v1/chat/completions"):   # and a few against the real server
            status, headers, raw = front.request("POST", path, {"Authorization": f"Bearer {KEY}"}, body)
            assert 400 <= status < 500 and headers["content-type"] == "application/json", (status, raw[:200])
            assert "error" in json.loads(raw)


def test_routing_errors_limits_and_cancellation_are_answered_and_counted(front):
    bearer = {"Authorization": f"Bearer {KEY}"}
    cases = [("GET", "/no/such/route", None, 404, "not_found"),
             ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
             ("POST", "/v1/completions", json.dumps({"prompt": "x", "stop": list("abcde")}).encode(), 400, None),
             ("POST", "/v1/completions", json.dumps({"prompt": "x", "temperature": 2.5}).encode(), 400, None)]
    for method, path, body, expected, code in cases:
        status, headers, raw = front.request(method, path, bearer, body)
        assert status == expected and headers["content-type"] == "application/json", (path, raw)
        assert json.loads(raw)["error"]["code"] == code
    hostile_headers = [{"Authorization": "Bearer " + "x" * 60_000}, {"Authorization": "Bearer \xff\xfe\x80"},
                       {"Authorization": "bEaReR  " + KEY + " trailing"}, {"X-Padding": "y" * 60_000},
                       dict(bearer, **{f"X-Many-{i}": "z" for i in range(300)}),
                       dict(bearer, **{"Content-Length": "many"}), dict(bearer, **{"Content-Length": "-1"})]
    for headers in hostile_headers:   # never a 5xx (issue 27 saw 503s): 4xx, or the connection refused
        try:
            status = front.request("POST", "/v1/completions", headers, b"{}")[0]
        except (ConnectionError, http.client.HTTPException):
            continue
        assert 400 <= status < 500, (list(headers)[:2], status)
    with front.channel(1) as channel:   # gRPC: the same limits as HTTP
        for sampling in (pb.SamplingParams(temperature=2.5), pb.SamplingParams(stop=list("abcde")),
                         pb.SamplingParams(stop=["s" * 257])):
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(text="x", sampling=sampling),
                                                             metadata=AUTH, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    name = 'shardserve_requests_total{endpoint="completions",outcome="cancelled",status="200"}'
    before = front.metrics().get(name, 0)
    conn = http.client.HTTPSConnection("127.0.0.1", front.port, context=front.context, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": COUNT, "max_tokens": 400, "stream": True}),
                 dict(bearer, **{"Content-Type": "application/json"}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()   # the client leaves mid-stream
    wait_for("the cancelled stream counted", lambda: front.metrics().get(name, 0) == before + 1, 30)
    wait_idle(front, timeout_s=30)


def test_health_polls_stay_out_of_the_access_log(front):
    for _ in range(3):
        assert front.request("GET", "/health")[0] == 200
    (router_log,) = (front.logs / "serve").glob("replica_*OpenAIRouter*.log")
    text = router_log.read_text()
    assert "POST /v1/completions" in text and "GET /health" not in text   # start-up polled /health often


def decode_gaps(channel, max_tokens: int = 40) -> list[float]:
    """Seconds between the streamed tokens of one greedy request (after the first)."""
    stamps = []
    for response in pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
            text=COUNT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)),
            metadata=AUTH, timeout=300):
        stamps += [time.monotonic()] * len(response.token_ids)
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]


def test_a_4mb_tokenize_does_not_stall_a_concurrent_stream(front):
    """Issue 27: tokenization runs on the replica's tokenizer threads (low CPU priority), not on the
    event loop that drives decoding. Same-run ratio of the stream's TPOT with and without a 4 MB
    ``Tokenize`` in flight on the same replica; a generous bound (3x) on a shared 2-core machine."""
    wait_idle(front)
    text = ("hello world, this is a long text to tokenize. " * 100_000)[:4 * 1024 * 1024]
    with front.channel(1) as channel:
        alone = decode_gaps(channel)
        tokenize = pb_grpc.InferenceStub(channel).Tokenize.future(pb.TokenizeRequest(text=text), metadata=AUTH,
                                                                  timeout=300)
        time.sleep(0.5)   # the 4 MB message arrived and tokenization started
        during = decode_gaps(channel)
        overlapped = not tokenize.done()
        tokenize.cancel()   # the thread finishes on its own; the stream's time is what is measured
    mean_alone, mean_during = sum(alone) / len(alone), sum(during) / len(during)
    median_alone, median_during = statistics.median(alone), statistics.median(during)
    print(f"TPOT alone {mean_alone * 1e3:.1f} ms (median {median_alone * 1e3:.1f}), during a 4 MB Tokenize "
          f"{mean_during * 1e3:.1f} ms (median {median_during * 1e3:.1f}): x{mean_during / mean_alone:.2f} "
          f"(median x{median_during / median_alone:.2f}); the longest gap {max(during) * 1e3:.0f} ms "
          f"(on the event loop it was the whole tokenization); overlapped: {overlapped}")
    assert overlapped, "the Tokenize finished before the stream did: nothing was measured"
    # The median: other processes' bursts swing the mean. 3x: on 2 cores the tokenizer thread alone
    # may take one of the rank's two cores (TPOT x2 with no stall at all; x2.59 seen under load); a
    # stall of the loop puts the whole tokenization in one gap, which max() catches.
    assert median_during <= 3 * median_alone and max(during) < 5.0


def test_ctrl_c_stops_the_server_and_leaves_no_port_open(front):
    front.proc.send_signal(signal.SIGINT)
    assert front.proc.wait(90) == 0
    wait_for("the goodbye line", lambda: any("shutting down" in line for line in front.stdout), 10)
    for address in [f"127.0.0.1:{front.port}", front.grpc_endpoint] + front.grpc_addresses:
        host, port = address.split(":")
        with socket.socket() as sock, pytest.raises(OSError):
            sock.connect((host, int(port)))
