"""The OpenAI front's rules without a cluster: request validation, error bodies, routing to the
replica with the fewest outstanding tokens, 503 while loading, app arguments. Fast (no model)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import yaml

from shardserve.cluster.frontend.openai_protocol import OpenAIError, parse_chat, parse_completion
from shardserve.cluster.frontend.openai_router import RouterCore
from shardserve.cluster.frontend.replica_pool import NoReplicaReady, ReplicaPool
from shardserve.cluster.serve_app import ServeArgs, build_app

CHAT = [{"role": "user", "content": "hi"}]


def error_of(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse(body)
    return err.value


@pytest.mark.parametrize("parse,body,param,fragment", [
    (parse_chat, {"model": "m"}, "messages", "'messages' is a required property"),
    (parse_chat, {"messages": []}, "messages", "non-empty"),
    (parse_chat, {"messages": [{"content": "x"}]}, "messages", "'role'"),
    (parse_chat, {"messages": CHAT, "temperature": -1}, "temperature", "'temperature' must be in [0, 2], got -1"),
    (parse_chat, {"messages": CHAT, "top_p": 0}, "top_p", "top_p"),
    (parse_chat, {"messages": CHAT, "n": 0}, "n", "'n'"),
    (parse_chat, {"messages": CHAT, "max_tokens": 0}, "max_tokens", "max_tokens"),
    (parse_chat, {"messages": CHAT, "max_completion_tokens": "5"}, "max_completion_tokens", "integer"),
    (parse_chat, {"messages": CHAT, "stop": [""]}, "stop", "stop"),
    (parse_chat, {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    (parse_chat, {"messages": CHAT, "temperature": 2.5}, "temperature", "'temperature' must be in [0, 2], got 2.5"),
    (parse_chat, {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    (parse_chat, {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    (parse_chat, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    (parse_chat, {"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2]"),
    (parse_chat, {"messages": CHAT, "response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    (parse_chat, {"messages": CHAT, "response_format": "text"}, "response_format", "an object"),
    (parse_chat, {"messages": CHAT, "stream": True, "stream_options": {"include_usage": "x"}}, "stream_options",
     "boolean"),
    (parse_chat, {"messages": CHAT, "stream": True, "stream_options": {"usage": True}}, "stream_options", "unknown"),
    (parse_chat, {"messages": [{"role": "user", "content": None}]}, "messages", "content is required"),
    (parse_chat, {"messages": [{"role": "system"}]}, "messages", "content is required"),
    (parse_completion, {"prompt": ""}, "prompt", "'prompt' must not be empty"),
    (parse_completion, {"prompt": []}, "prompt", "must not be empty"),
    (parse_completion, {}, "prompt", "required"),
    (parse_completion, {"prompt": "x", "logprobs": 6}, "logprobs", "logprobs"),
    (parse_completion, {"prompt": [1, "a"]}, "prompt", "prompt"),
    (parse_completion, {"prompt": "x", "ignore_eos": 1}, "ignore_eos", "boolean"),
    (parse_chat, {"messages": CHAT, "logprobs": "false"}, "logprobs", "must be a boolean"),
    (parse_completion, {"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    (parse_completion, {"prompt": "x", "echo": True}, "echo", "not supported"),
    (parse_completion, {"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    (parse_completion, {"prompt": "x", "include_stop_str_in_output": True}, "include_stop_str_in_output",
     "not supported"),
    (parse_completion, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    (parse_completion, {"prompt": "x", "use_beam_search": True}, "use_beam_search", "not supported"),
    (parse_completion, {"prompt": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens", "not supported"),
    (parse_chat, {"messages": CHAT, "continue_final_message": True}, "continue_final_message", "not supported"),
    (parse_chat, {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt", "not supported"),
    (parse_chat, {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template", "not supported"),
    (parse_completion, {"prompt": "x", "stop_token_ids": [1, "a"]}, "stop_token_ids", "list of token ids"),
    (parse_completion, {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens", "boolean"),
])
def test_bad_requests_are_400_with_openai_bodies(parse, body, param, fragment):
    err = error_of(parse, body)
    assert err.status == 400
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}
    assert fragment in err.message


def test_parsed_fields_follow_openai_defaults():
    chat = parse_chat({"messages": CHAT, "max_completion_tokens": 7, "stop": "\n", "seed": 3, "n": 2,
                       "logprobs": True, "top_logprobs": 2, "top_k": 5, "min_p": 0.1, "stream": True,
                       "stream_options": {"include_usage": True}})
    assert chat.sampling == {"stop": ["\n"], "max_tokens": 7, "top_k": 5, "min_p": 0.1}
    assert (chat.n, chat.seed, chat.logprobs, chat.stream, chat.include_usage) == (2, 3, 2, True, True)
    assert parse_chat({"messages": CHAT}).max_tokens is None           # chat: up to the context length
    assert parse_chat({"messages": CHAT, "response_format": {"type": "text"}}).prompts == [CHAT]   # the default
    assert parse_chat({"messages": CHAT + [{"role": "assistant", "content": None}]}).prompts[0][-1]["content"] == ""
    assert parse_completion({"prompt": "x"}).sampling["max_tokens"] == 16   # legacy default
    assert parse_completion({"prompt": "x", "ignore_eos": True}).sampling["ignore_eos"] is True   # vLLM extension
    assert parse_completion({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    assert parse_completion({"prompt": [1, 2]}).prompts == [[1, 2]]
    parts = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]})
    assert parts.prompts == [[{"role": "system", "content": "a\nb"}]]   # vLLM joins text parts with newlines
    extensions = parse_completion({"prompt": "x", "stop_token_ids": [7, 9], "skip_special_tokens": False,
                                   "best_of": 2, "n": 2, "suffix": "", "echo": False, "use_beam_search": False})
    assert extensions.sampling["stop_token_ids"] == [7, 9] and extensions.sampling["skip_special_tokens"] is False
    assert parse_chat({"messages": CHAT, "logprobs": False, "add_generation_prompt": True}).logprobs is None


def test_routing_picks_fewest_outstanding_tokens_and_pays_them_back():
    pool = ReplicaPool("012")
    for key in "012":
        pool.update(key, {"state": "ready", "address": None, "info": {"healthy": True}})
    first = pool.pick(100, 50)                  # all idle: replica 0 (least recently used)
    second = pool.pick(10, 10)                  # 0 holds 150: replica 1
    third = pool.pick(10, 10)                   # 1 and 2 hold 20 / 0: replica 2
    assert [lease.replica.key for lease in (first, second, third)] == ["0", "1", "2"]
    assert pool.pick(1, 1).replica.key == "1"   # 1: 20, 2: 20 -> 1 was used less recently
    first.prefilled(100)                        # prefill done: 0 now holds its 50 output tokens
    first.generated(30)
    assert pool.replicas[0].outstanding_tokens == 20 and pool.replicas[0].outstanding_requests == 1
    assert pool.pick(1, 1, exclude=("1", "2")).replica.key == "0"
    first.release()
    first.release()                             # idempotent
    assert pool.replicas[0].outstanding_tokens == 2 and pool.replicas[0].outstanding_requests == 1


def test_routing_skips_replicas_that_are_not_ready():
    pool = ReplicaPool("01")
    with pytest.raises(NoReplicaReady, match="0/2 replicas ready"):
        pool.pick(1, 1)
    pool.update("1", {"state": "ready", "address": None, "info": {"healthy": True}})
    assert pool.pick(1, 1).replica.key == "1"
    pool.mark_unreachable(pool.replicas[1], "UNAVAILABLE")
    with pytest.raises(NoReplicaReady, match="unreachable"):
        pool.pick(1, 1)
    pool.update("1", {"state": "ready", "address": None, "info": {"healthy": False}})  # a rank died
    assert pool.replicas[1].state == "failed"


def test_health_says_recovering_while_the_only_replica_repairs_itself():
    """README: a replica repairing a dead worker in place reports ``recovering``; ``/health`` said
    ``loading`` then (an outside check read it after killing a draft worker)."""
    async def recovering() -> dict:
        return {"state": "recovering", "address": None, "error": None, "info": None}

    async def scenario():
        core = RouterCore("m", ["m"], [recovering], load_tokenizer=lambda: object(), poll_s=0.01)
        core.start()
        await asyncio.sleep(0.05)
        try:
            return await core.health()
        finally:
            await core.close()

    health = asyncio.run(scenario())
    assert health.status_code == 503 and json.loads(health.body) == {"status": "recovering"}


def test_router_answers_503_while_loading_and_checks_model_and_params_first():
    async def loading() -> dict:
        return {"state": "loading", "address": None, "error": None, "info": None}

    async def scenario():
        core = RouterCore("smollm2-135m-instruct", ["smollm2-135m-instruct"], [loading, loading],
                          load_tokenizer=lambda: None, poll_s=0.01)
        core.start()
        await asyncio.sleep(0.05)
        try:
            return [await core.health(), await core.models(),
                    await core.generate("chat", json.dumps({"messages": CHAT}).encode()),
                    await core.generate("chat", json.dumps({"messages": CHAT, "model": "gpt-4"}).encode()),
                    await core.generate("completion", b'{"prompt": "x", "temperature": -1}'),
                    await core.generate("completion", b"{not json")]
        finally:
            await core.close()

    health, models, chat, unknown, bad, not_json = asyncio.run(scenario())
    assert health.status_code == 503 and json.loads(health.body) == {"status": "loading"}   # nothing more: open
    for response in (models, chat):
        body = json.loads(response.body)
        assert response.status_code == 503 and body["error"]["type"] == "service_unavailable_error"
        assert "loading" in body["error"]["message"] and "0/2 replicas ready" in body["error"]["message"]
    assert unknown.status_code == 404
    assert json.loads(unknown.body)["error"]["code"] == "model_not_found"
    assert bad.status_code == 400 and json.loads(bad.body)["error"]["param"] == "temperature"
    assert not_json.status_code == 400 and "not valid JSON" in json.loads(not_json.body)["error"]["message"]


def test_app_arguments():
    args = ServeArgs.from_dict({"tensor_parallel_size": 2, "data_parallel_size": 2, "cpus_per_worker": 1})
    assert args.replica_bundles() == [{"CPU": 1.0}, {"CPU": 1}, {"CPU": 1}]
    assert args.cpus_needed() == 1 + 2 * 3
    assert ServeArgs.from_dict({"model": "/x/Some-Model.Q4.gguf"}).served_names()[:2] == ["Some-Model.Q4",
                                                                                          "/x/Some-Model.Q4.gguf"]
    with pytest.raises(ValueError, match="unknown shardserve app argument"):
        ServeArgs.from_dict({"tensor_parallel": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ServeArgs.from_dict({"tensor_parallel_size": 0})
    assert ServeArgs.from_dict({"indexer_cache_dtype": "fp8"}).engine_args().indexer_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="indexer-cache-dtype"):
        ServeArgs.from_dict({"indexer_cache_dtype": "fp4"})
    assert ServeArgs.from_dict({"dsa_sink": 1}).engine_args().dsa_sink == 1
    with pytest.raises(ValueError, match="dsa-sink"):
        ServeArgs.from_dict({"dsa_sink": 3, "dsa_top_k": 2})
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        build_app({"model": "/no/such/model.gguf"})
    gpu = ServeArgs.from_dict({"tensor_parallel_size": 2, "device": "cuda", "dtype": "bfloat16"})
    assert gpu.replica_bundles() == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert gpu.engine_args().dtype == "bfloat16" and gpu.group_config().device == "cuda"
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        ServeArgs.from_dict({"gpu_memory_utilization": 1.2})


def test_no_key_reaches_serve_init_args_only_digests_do():
    """Issue 27: the deployments' init args (visible in Serve's state and dashboard) hold SHA-256
    digests, never a key; the replicas' handles and the router's args alike."""
    from shardserve.cluster.frontend.security import key_digest

    app = build_app({"api_key": "sk-plain-key", "admin_api_key": "sk-admin-plain", "data_parallel_size": 2})
    router = app._bound_deployment
    args, replicas = router.init_args
    for raw in [args, replicas._bound_deployment.init_args[0]]:
        text = json.dumps(raw)
        assert "sk-plain-key" not in text and "sk-admin-plain" not in text
        assert raw["api_key_sha256"] == [key_digest("sk-plain-key")]
        assert raw["admin_api_key_sha256"] == [key_digest("sk-admin-plain")]
    front = ServeArgs.from_dict(args).front_config()
    assert front.identify("Bearer sk-plain-key").role == "client" and front.identify("Bearer sk-admin-plain").role == "admin"


def test_serve_config_and_kuberay_manifest_hold_valid_app_arguments(monkeypatch):
    monkeypatch.setenv("SHARDSERVE_API_KEY", "sk-from-the-secret")   # the pods' grpc_host 0.0.0.0 needs a key
    repo = Path(__file__).resolve().parents[2]
    serve_config = yaml.safe_load((repo / "serve_config.yaml").read_text())
    manifest = next(yaml.safe_load_all((repo / "k8s" / "rayservice.yaml").read_text()))
    for config in (serve_config, yaml.safe_load(manifest["spec"]["serveConfigV2"])):
        (app,) = config["applications"]
        assert app["import_path"] == "shardserve.cluster.serve_app:build_app"
        args = ServeArgs.from_dict(app["args"])
        assert args.tensor_parallel_size == 2 and args.model == "smollm2-135m-instruct"


# -- the HTTP app in-process: the same builder Serve runs (no replicas: everything here is answered
#    before a replica is needed) -------------------------------------------------------------------

KEY = "sk-test-key"
ADMIN = "sk-admin-key"


async def _loading() -> dict:
    return {"state": "loading", "address": None, "error": None, "info": None}


def app_requests(requests: list[tuple[str, str, dict, bytes | None]], api_keys=(KEY,), patch=None,
                 admin_keys=(), limits=None) -> list:
    """Send ``(method, path, headers, body)`` to a fresh app (router core with one loading replica)
    through ASGI in this process; returns the ``httpx2`` responses."""
    import httpx2

    from shardserve.cluster.frontend.limits import Limits
    from shardserve.cluster.frontend.openai_app import build_openai_app
    from shardserve.cluster.frontend.security import FrontConfig

    async def scenario():
        front = FrontConfig.from_keys(list(api_keys), list(admin_keys), limits=limits or Limits())
        core = RouterCore(MODEL, [MODEL], [_loading], load_tokenizer=lambda: None, poll_s=0.01, front=front)
        core.start()
        if patch:
            patch(core)
        app = build_openai_app(core)
        try:
            async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://app") as client:
                return [await client.request(m, p, headers=h, content=b) for m, p, h, b in requests], app
        finally:
            await core.close()

    return asyncio.run(scenario())


MODEL = "smollm2-135m-instruct"
BEARER = {"Authorization": f"Bearer {KEY}"}


def test_every_route_and_unknown_paths_need_the_key_except_health():
    (_, app) = app_requests([])
    routes = [(method, route.path.replace("{model:path}", MODEL)) for route in app.routes
              for method in sorted(route.methods)] + [("GET", "/no/such/route"), ("POST", "/v1/chat/completion")]
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/openapi.json") in routes
    assert ("POST", "/admin/reload_weights") in routes, "admin routes are on the guarded app"
    bad_auth = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
    requests = [(m, p, h, b"{}" if m == "POST" else None) for m, p in routes for h in bad_auth]
    responses, _ = app_requests(requests)
    for (method, path, headers, _), resp in zip(requests, responses):
        if path == "/health":
            assert resp.status_code == 503, (method, path)        # open (GET and HEAD): loading, not 401
            continue
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", (method, path, headers)
        if method != "HEAD":
            assert resp.json()["error"]["code"] == "invalid_api_key"
    with_key, _ = app_requests([(m, p, BEARER, b"{}" if m == "POST" else None) for m, p in routes])
    assert all(resp.status_code != 401 for resp in with_key)


def test_admin_routes_take_the_admin_key_only_and_are_off_without_one():
    """Issue 27: 404 without an admin key configured; 403 for an inference key; 401 without a key."""
    admin = [("POST", "/admin/reload_weights", b'{"mode": "bogus"}'), ("GET", "/admin/status", None),
             ("GET", "/admin/anything", None)]
    off, _ = app_requests([(m, p, BEARER, b) for m, p, b in admin])
    assert [r.status_code for r in off] == [404, 404, 404] and off[0].json()["error"]["code"] == "not_found"
    keys = [{}, BEARER, {"Authorization": f"Bearer {ADMIN}"}]
    on, _ = app_requests([(m, p, h, b) for m, p, b in admin for h in keys], admin_keys=[ADMIN])
    statuses = [r.status_code for r in on]
    assert statuses[0:3] == [401, 403, 400]    # reload: the admin key reaches the route (its own 400)
    assert statuses[3:6] == [401, 403, 200]    # status: replicas and per-key counters, admin only
    assert statuses[6:9] == [401, 403, 404]
    status = on[5].json()
    assert status["replicas"][0]["state"] == "loading" and "prefix_cache_hit_tokens_by_key" in status
    assert ADMIN not in on[5].text and KEY not in on[5].text
    open_server, _ = app_requests([("GET", "/admin/status", {}, None), ("GET", "/v1/models", {}, None)],
                                  api_keys=(), admin_keys=[ADMIN])
    assert [r.status_code for r in open_server] == [401, 503]   # no inference key: inference open, admin not


async def chunks(*parts: bytes):
    for part in parts:
        yield part


def test_limits_answer_before_any_work():
    """413 for a body over the limit (declared or streamed), 400 for too many choices or prompt
    characters, 429 with Retry-After past the key's rate: all before the (loading) replicas matter."""
    from shardserve.cluster.frontend.limits import Limits

    limits = Limits(max_request_body_bytes=1000, max_prompt_chars=50, max_choices=4, rate_limit_requests=2)
    big = json.dumps({"prompt": "x" * 2000}).encode()
    requests = [("POST", "/v1/completions", BEARER, big),
                ("POST", "/v1/completions", BEARER, chunks(big[:900], big[900:])),   # no Content-Length
                ("POST", "/v1/completions", BEARER, json.dumps({"prompt": "y" * 51}).encode()),
                ("POST", "/v1/completions", BEARER, json.dumps({"prompt": ["a", "b", "c"], "n": 2}).encode()),
                ("POST", "/v1/completions", BEARER, json.dumps({"prompt": "z"}).encode())]
    responses, _ = app_requests(requests, limits=limits)
    codes = [(r.status_code, r.json()["error"]["code"]) for r in responses]
    assert codes[:2] == [(413, "request_too_large")] * 2 and codes[2][0] == 400 and codes[3][0] == 400
    assert "--max-prompt-chars" in responses[2].text and "--max-choices" in responses[3].text
    assert codes[4] == (429, "rate_limit_exceeded") and int(responses[4].headers["retry-after"]) >= 1


def test_routing_errors_and_bad_unicode_are_openai_bodies_and_a_crash_is_a_json_500():
    def crash(core):
        async def boom(kind, body, caller=None):
            raise RuntimeError("unexpected")
        core.generate = boom

    requests = [("GET", "/no/such/route", BEARER, None), ("GET", "/v1/chat/completions", BEARER, None),
                ("DELETE", "/v1/models", BEARER, None), ("GET", f"/v1/models/not-{MODEL}", BEARER, None),
                ("POST", "/v1/completions", BEARER, b'{"prompt": "\\ud800 x", "max_tokens": 2}'),
                ("POST", "/v1/chat/completions", BEARER,
                 b'{"messages": [{"role": "user", "content": "a\\udfff"}], "user": "u"}'),
                ("POST", "/v1/completions", BEARER, b"[" * 100_000 + b"]" * 100_000),
                ("POST", "/v1/completions", BEARER, b'{"prompt": "\xff\xfe"}')]
    responses, _ = app_requests(requests)
    codes = [(r.status_code, r.json()["error"]["code"]) for r in responses]
    assert codes == [(404, "not_found"), (405, "method_not_allowed"), (405, "method_not_allowed"),
                     (404, "model_not_found"), (400, None), (400, None), (400, None), (400, None)]
    assert responses[1].headers["allow"] == "POST"
    assert responses[4].json()["error"]["param"] == "prompt" and "not valid Unicode" in responses[4].text
    assert responses[5].json()["error"]["param"] == "messages"
    assert "nested too deeply" in responses[6].text and "not valid JSON" in responses[7].text
    (crashed,), _ = app_requests([("POST", "/v1/completions", BEARER, b"{}")], patch=crash)
    assert crashed.status_code == 500 and crashed.headers["content-type"] == "application/json"
    assert crashed.json()["error"]["type"] == "server_error" and "unexpected" not in crashed.text


def test_a_client_that_leaves_is_not_an_error(caplog):
    """A client gone before its body is read (Starlette's ClientDisconnect) or mid-stream (Serve
    cancels the handler: TaskCancelledError) is logged at INFO, with nothing sent back; a real crash
    still logs an ERROR (and answers a JSON 500)."""
    from ray.exceptions import TaskCancelledError

    from shardserve.cluster.frontend.openai_app import build_openai_app

    async def scenario(generate, first_message: dict) -> list[dict]:
        core = RouterCore(MODEL, [MODEL], [_loading], load_tokenizer=lambda: None, poll_s=0.01)
        core.generate = generate
        app, sent = build_openai_app(core), []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("app", 80), "client": ("c", 1), "http_version": "1.1"}

        async def receive():
            return first_message

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent

    async def cancelled(kind, body, caller=None):
        raise TaskCancelledError()

    async def crash(kind, body, caller=None):
        raise RuntimeError("unexpected")

    gone, body = {"type": "http.disconnect"}, {"type": "http.request", "body": b"{}", "more_body": False}
    for generate, first, errors in [(crash, gone, 0), (cancelled, body, 0), (crash, body, 1)]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardserve.cluster.frontend.openai_app"):
            sent = asyncio.run(scenario(generate, first))
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == errors, caplog.text
        if errors:
            assert sent[0]["status"] == 500
        else:
            assert sent == [] and "client disconnected during POST /v1/completions" in caplog.text


def test_replica_count_autoscaling_options_and_the_default_routing():
    """Issue 28: a fixed count or Serve's autoscaling_config (our policy on the replicas' own
    load); prefix-aware routing by default once there can be two replicas."""
    from types import SimpleNamespace

    from shardserve.cluster.autoscaling import ONGOING_REQUESTS, POLICY_PATH, ongoing_requests_policy
    from shardserve.cluster.serve_app import ServeArgs

    fixed = ServeArgs.from_dict({"data_parallel_size": 3})
    assert fixed.replica_count_options() == {"num_replicas": 3} and fixed.routing_policy().name == "prefix-aware"
    assert ServeArgs.from_dict({}).routing_policy().name == "least-loaded"
    scaled = ServeArgs.from_dict({"max_replicas": 4, "max_num_seqs": 16, "routing": "least-loaded"})
    config = scaled.replica_count_options()["autoscaling_config"]
    assert (config["min_replicas"], config["initial_replicas"], config["max_replicas"]) == (1, 1, 4)
    assert config["target_ongoing_requests"] == 8 and config["policy"] == {"policy_function": POLICY_PATH}
    assert scaled.routing_policy().name == "least-loaded" and scaled.max_num_replicas() == 4
    assert "max_replicas" not in scaled.replica_args() and "routing" not in scaled.replica_args()

    def ctx(loads, current=2, low=1, high=4):
        return SimpleNamespace(aggregated_metrics={ONGOING_REQUESTS: dict(enumerate(loads))},
                               current_num_replicas=current, target_num_replicas=current,
                               capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
                               config=SimpleNamespace(get_target_ongoing_requests=lambda: 8.0))

    assert ongoing_requests_policy(ctx([8.0, 8.0]))[0] == 2      # at target
    assert ongoing_requests_policy(ctx([12.0, 9.0]))[0] == 3     # 21 / 8 -> 3
    assert ongoing_requests_policy(ctx([40.0, 40.0]))[0] == 4    # capped at max
    assert ongoing_requests_policy(ctx([0.0, 0.0]))[0] == 1      # idle: down to min, never zero
    assert ongoing_requests_policy(SimpleNamespace(aggregated_metrics={}, current_num_replicas=2,
                                                   target_num_replicas=2))[0] == 2   # no load reported yet


def test_health_sees_a_short_outage_and_a_late_status_failure_keeps_a_ready_replica():
    """The router polls ready replicas every 0.5 s (``poll_s``): a replica unhealthy for ~1 s (a
    dead worker repaired in place) is seen red by ``GET /health`` and green again after. With the
    2-s period of before, a draft worker killed under four streams and repaired in ~2 s left
    /health at 200 throughout in 2 of 4 runs. A status call sent while a replica loaded that fails
    after it became ready (a newer answer said so) does not mark it unreachable."""
    healthy = {"value": True}

    async def replica() -> dict:
        return {"state": "ready", "address": None, "error": None, "info": {"healthy": healthy["value"]}}

    answers = iter([{"state": "loading", "address": None, "error": None, "info": None}])

    async def slow_then_ready() -> dict:
        if next(answers, None) is None:
            return {"state": "ready", "address": None, "error": None, "info": {"healthy": True}}
        await asyncio.sleep(0.3)
        raise TimeoutError("sent while loading, late")

    async def first_status(core, code: int, within_s: float):
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            response = await core.health()
            if response.status_code == code or asyncio.get_running_loop().time() > deadline:
                return response
            await asyncio.sleep(0.05)

    async def scenario():
        core = RouterCore("m", ["m"], [replica], load_tokenizer=lambda: object())
        core.start()
        await asyncio.wait_for(core.wait_started(), 5)
        healthy["value"] = False
        red = await first_status(core, 503, 1.0)
        healthy["value"] = True
        green = await first_status(core, 200, 1.0)
        await core.close()
        late = RouterCore("m", ["m"], [slow_then_ready], load_tokenizer=lambda: object())
        late.pool.add("0")                             # loading
        slow = asyncio.ensure_future(late._poll("0"))   # goes out while the replica loads
        await asyncio.sleep(0.05)
        await late._poll("0")                          # a newer answer: ready
        await slow
        return red, green, [r.state for r in late.pool.replicas]

    red, green, late_states = asyncio.run(scenario())
    assert (red.status_code, json.loads(red.body)) == (503, {"status": "unhealthy"})
    assert (green.status_code, json.loads(green.body)) == (200, {"status": "ok"})
    assert late_states == ["ready"]
