"""The command line's contract without loading a model or starting Ray: every flag documents its
default and unit, bad arguments are one line and exit code 2 before anything loads, ``--stop``
escapes; and the front door's building blocks (API keys and roles, secure bind defaults, TLS pairs,
limits, the reload root)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.cluster import cli
from shardserve.cluster.frontend.limits import LimitExceeded, Limits, RateLimiter, parse_rate_limit
from shardserve.cluster.frontend.security import (
    FrontConfig, contained_path, is_loopback, key_digest, load_api_keys, refuse_exposed)

# A numeric flag names its unit with one of these words (or is listed as unitless).
UNITS = ("token", "GiB", "second", "request", "sequence", "rank", "CPU", "GPU", "port", "replica", "keys", "pod",
         "bytes", "characters", "prompts")
UNITLESS = {"--seed", "--temperature", "--top-p", "--tensor-split"}


def every_option():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            yield name, action, formatter._get_help_string(action) % {"default": action.default}


def test_every_flag_has_help_with_its_default_and_unit():
    checked = 0
    for command, action, text in every_option():
        flag = max(action.option_strings or [action.dest], key=len)
        assert text.strip(), f"{command} {flag}: no help"
        if not action.required:
            assert "default" in text, f"{command} {flag}: help does not say the default: {text!r}"
        if action.type in (int, float) and flag not in UNITLESS:
            assert any(unit in text for unit in UNITS), f"{command} {flag}: no unit in {text!r}"
        checked += 1
    assert checked > 80


def test_stop_escapes_are_decoded():
    assert cli._unescape(r"\n\n") == "\n\n"
    assert cli._unescape(r"a\tb\\n\x") == "a\tb\\n\\x"   # \\ is a backslash; unknown escapes stay
    assert cli._unescape("é\n") == "é\n"


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a model or starting Ray fails the test: bad arguments must be found before."""
    def boom(*args, **kwargs):
        raise AssertionError("started loading before the arguments were checked")

    import shardserve.cluster.llm as llm

    monkeypatch.setattr(llm, "LLM", boom)
    monkeypatch.setattr(cli, "init_ray", boom)


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "0"], "max_tokens must be at least 1"),
    (["--temperature", "2.5"], "temperature must be in [0, 2]"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be"),
    (["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"], "at most 4 stop strings"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--model", "/no/such/model.gguf"], "no such file or folder"),
    (["--packed-dense-rows", "99999999999999999999"], "exceeds --max-num-batched-tokens 2048"),
    (["--regex", "("], "structured_outputs: the regex does not compile"),
])
def test_generate_checks_its_arguments_before_loading_the_model(flags, message, nothing_loads, capsys):
    argv = ["generate", "--prompt", "hi"] + flags
    code, err = run_main(argv, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_file_that_is_not_gguf_says_so(tmp_path, nothing_loads, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    code, err = run_main(["generate", "--prompt", "hi", "--model", str(tmp_path / "model.safetensors")], capsys)
    assert code == 2 and "not .gguf" in err



@pytest.mark.parametrize("command", ["generate", "serve", "serve-grpc"])
def test_quantization_of_a_known_gguf_model_is_refused_before_anything_loads(command, nothing_loads, capsys):
    """A known name counts as the GGUF file it stands for; nothing is resolved or downloaded to say so."""
    argv = [command, "--model", "smollm2-135m-instruct", "--quantization", "int8"]
    code, err = run_main(argv + (["--prompt", "hi"] if command == "generate" else []), capsys)
    assert code == 2 and "is a GGUF file, quantized already" in err and err.count("\n") == 1, err

@pytest.mark.parametrize("command", ["serve", "serve-grpc"])
@pytest.mark.parametrize("flags,message", [
    (["--api-key-file", "/no/such/keys.txt"], "--api-key-file /no/such/keys.txt: no such file"),
    (["--api-key", ""], "must not be empty"),
    (["--api-key", "a,,b"], "must not be empty"),
    (["--grpc-tls-cert", "/etc/hostname"], "--grpc-tls-cert needs --grpc-tls-key"),
    (["--grpc-tls-key", "/etc/hostname"], "--grpc-tls-key needs --grpc-tls-cert"),
    (["--grpc-tls-cert", "/no/cert.pem", "--grpc-tls-key", "/etc/hostname"], "--grpc-tls-cert /no/cert.pem: no such"),
    (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1"),
    (["--request-timeout", "-1"], "--request-timeout must be > 0"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars must be a positive integer"),
    (["--rate-limit", "ten"], "--rate-limit takes REQUESTS[,TOKENS]"),
    (["--api-key", "same", "--admin-api-key", "same"], "must not also be an inference API key"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 would let anyone who reaches it use the model"),
    (["--cpus-per-worker", "-1"], "must be > 0, got -1.0"),
    (["--cpus-per-worker", "0"], "must be > 0, got 0.0"),   # was silently the default
    (["--gpus-per-worker", "-1"], "must be >= 0, got -1.0"),
])
def test_front_door_settings_are_checked_before_ray_starts(command, flags, message, nothing_loads, capsys):
    code, err = run_main([command, "--model", "smollm2-135m-instruct"] + flags, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_https_certificate_without_its_key_is_one_line_and_exit_2():
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "serve", "--ssl-certfile", "/etc/hostname"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr == "shardserve: error: --ssl-certfile needs --ssl-keyfile too\n"


def test_haproxy_ingress_with_https_is_one_line_and_exit_2(tmp_path):
    """Ray's HAProxy ingress does not terminate TLS: refused before the model is fetched or Ray starts."""
    exe = Path(sys.executable).parent / "shardserve"
    (tmp_path / "c.pem").write_text("x")
    (tmp_path / "k.pem").write_text("x")
    proc = subprocess.run([str(exe), "serve", "--ingress", "haproxy", "--ssl-certfile", str(tmp_path / "c.pem"),
                           "--ssl-keyfile", str(tmp_path / "k.pem")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("shardserve: error: --ingress haproxy cannot serve HTTPS")
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_ingress_auto_is_haproxy_unless_https():
    from shardserve.cluster.ingress import ingress_env, resolve_ingress

    assert (resolve_ingress("auto", tls=False), resolve_ingress("auto", tls=True)) == ("haproxy", "serve-proxy")
    assert ingress_env("serve-proxy", local=True) == {}
    local, pods = ingress_env("haproxy", local=True), ingress_env("haproxy", local=False)
    assert local["RAY_SERVE_ENABLE_HA_PROXY"] == pods["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # a local server's HAProxy stats page and exporter get free ports, not Ray's fixed 8404 / 9101
    assert {"RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"} <= local.keys() - pods.keys()
    for _ in range(50):   # two different ports, neither one the command binds itself
        env = ingress_env("haproxy", local=True, own_ports={20001, 20002})
        ports = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
        assert len(ports) == 2 and not ports & {20001, 20002}


def test_unused_ports_avoid_the_ranges_others_take_ports_from():
    """A port picked now and bound a minute later lies outside the kernel's ephemeral range (where
    every outgoing connection's local port comes from) and Ray's worker ports, and binds."""
    import socket

    from shardserve.cluster.ports import _ephemeral_range, unused_port

    low, high = _ephemeral_range()
    ports = {unused_port() for _ in range(200)}
    assert all(20000 <= p <= 32767 and not low <= p <= high for p in ports), ports
    assert not any(30000 <= p <= 31000 for p in ports), ports   # Ray Serve's direct-ingress HTTP ports
    assert len(ports) > 1   # random: two servers started together rarely pick the same one
    assert unused_port(avoid=ports) not in ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_non_loopback_bind_without_a_key_is_refused_by_the_real_command(command="serve"):
    """Issue 27's secure default, as a user meets it: one line, exit code 2, nothing started
    (``serve-grpc`` alike: test_front_door_settings_are_checked_before_ray_starts)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSERVE_API_KEY", "SHARDSERVE_ADMIN_API_KEY")}
    proc = subprocess.run([str(Path(sys.executable).parent / "shardserve"), command, "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("shardserve: error: --host 0.0.0.0 would let anyone") and "--allow-unauthenticated" \
        in proc.stderr


def test_api_keys_come_from_the_flag_a_file_or_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# operators\nk2\n\nk3\n")
    assert load_api_keys("k1, k2", str(keys), env={}) == ["k1", "k2", "k3"]
    assert load_api_keys(None, None, env={"SHARDSERVE_API_KEY": "env-key"}) == ["env-key"]
    assert load_api_keys([], None, env={"SHARDSERVE_API_KEY": "env-key"}) == []   # resolved: none
    assert load_api_keys(None, None, env={}) == []
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(None, str(tmp_path / "empty"))
    front = FrontConfig.from_keys(["k1"], ["adm"])
    assert "k1" not in repr(front) and "adm" not in repr(front)   # never in a log line
    assert "k1" not in str(front.api_key_digests) and front.api_key_digests == [key_digest("k1")]


def test_callers_are_identified_by_role_and_never_by_key_text():
    front = FrontConfig.from_keys(["alpha", "beta"], ["root-key"], internal_digest=key_digest("tok"))
    assert front.identify("Bearer beta").role == "client" and front.identify("bearer alpha").role == "client"
    assert front.identify("Bearer root-key").role == "admin" and front.identify("Bearer tok").role == "internal"
    beta = front.identify("Bearer beta")
    assert beta.key_id == "key-" + key_digest("beta")[:12] and "beta" not in beta.key_id
    assert beta.tenant == key_digest("beta") and not beta.privileged and front.identify("Bearer tok").privileged
    for header in (None, "", "beta", "Bearer", "Bearer bet", "Bearer betaa", "Basic beta", "Bearer \udc80"):
        assert front.identify(header) is None, header
    open_front = FrontConfig.from_keys([], ["root-key"])   # no inference keys: anyone, but not admin
    assert open_front.identify(None).role == "anonymous" and open_front.identify("Bearer x").role == "anonymous"


def test_non_loopback_binds_without_a_key_are_refused_unless_allowed(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        refuse_exposed("0.0.0.0", False, False, "--host")
    refuse_exposed("0.0.0.0", True, False, "--host")
    refuse_exposed("127.0.0.1", False, False, "--host")
    with caplog.at_level(logging.WARNING):
        refuse_exposed("0.0.0.0", False, True, "--host")
    assert len(caplog.records) == 1 and "without an API key" in caplog.records[0].getMessage()
    assert cli.build_parser().parse_args(["serve-grpc"]).host == "127.0.0.1"
    assert cli.build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_paths_are_contained_in_the_allowed_root_without_an_existence_oracle(tmp_path):
    root = tmp_path / "models"
    (root / "ckpt").mkdir(parents=True)
    (root / "out").symlink_to(tmp_path)              # a link out of the root
    assert contained_path(root / "ckpt", root) == (root / "ckpt").resolve()
    assert contained_path(root / "missing", root) == (root / "missing").resolve()   # inside: the caller checks
    for outside in ("/etc/passwd", "/no/such/file", str(root / ".." / "x"), str(root / "out" / "x"), "relative"):
        assert contained_path(outside, root) is None, outside


def test_limits_and_rates():
    assert parse_rate_limit("60") == (60, None) and parse_rate_limit("60,1000") == (60, 1000)
    limits = Limits(max_prompt_chars=10, max_choices=4)
    limits.check_prompt_chars(10, "prompt")
    with pytest.raises(LimitExceeded) as err:
        limits.check_prompt_chars(11, "prompt")
    assert err.value.status == 400 and err.value.param == "prompt"
    with pytest.raises(LimitExceeded):
        limits.check_choices(2, 3)
    now = [0.0]
    rates = RateLimiter(2, 100, clock=lambda: now[0])
    rates.admit_request("k")
    rates.admit_request("k")
    with pytest.raises(LimitExceeded) as err:
        rates.admit_request("k")
    assert err.value.status == 429 and 29 < err.value.retry_after <= 30   # one request refills in 30 s
    rates.admit_request("other")                                          # per key
    charged = rates.charge_tokens("other", 80)
    with pytest.raises(LimitExceeded):
        rates.charge_tokens("other", 30)
    rates.settle("other", charged, 10)          # used 10 of 80: 70 back
    assert rates.charge_tokens("other", 30) == 30
    now[0] = 60.0
    rates.admit_request("k")                    # a minute later the budget is back


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--max-tokens", "abc"], ["serve", "--port", "99999"],
                                  ["serve-grpc", "--grpc-port", "-1"], ["serve", "--bogus-flag"], ["bogus"],
                                  ["serve", "--device", "tpu"], ["plan", "--packed-dense-rows", "\u00b2"],
                                  # inf / nan overflowed byte and CPU arithmetic (tracebacks) or passed unnamed
                                  ["plan", "--kv-cache-gib", "inf"], ["plan", "--gpu-memory-gib", "nan"],
                                  ["manifest", "--drain-timeout-s", "inf"], ["manifest", "--cpus-per-worker", "inf"],
                                  ["generate", "--temperature", "nan", "hi"], ["plan", "-tp", "2", "--tensor-split", "1,inf"]])
def test_usage_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "error:" in err and "usage" not in err, err


@pytest.mark.parametrize("command", ["serve", "serve-grpc"])
def test_a_port_in_use_is_one_line_before_anything_loads(command, capsys):
    import socket

    with socket.socket() as taken:   # a listener, like another server's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flag = "--port" if command == "serve" else "--grpc-port"
        assert cli.main([command, flag, str(port), "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} {port}" in err and "in use" in err, err


@pytest.mark.parametrize("flags", [["--memory-per-pod", "lots"], ["--head-memory", "4 GB"], ["--shm-size", "-1Gi"],
                                   ["--worker-pods", "0"], ["--port", "99999"]])
def test_manifest_refuses_values_kubernetes_would(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["manifest", "--image", "shardserve:test", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and flags[0] in err, err


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardserve {version('shardserve')}"


@pytest.mark.parametrize("argv,names", [
    (["serve", "--tool-call-parser", "nope"], "'deepseek_v3', 'deepseek_v31', 'deepseek_v32', 'glm45', 'glm47', "
                                              "'hermes', 'llama3_json'"),
    (["generate", "--prompt", "x", "--reasoning-parser", "r2"], "'deepseek_r1', 'deepseek_v3', 'glm45', 'qwen3'"),
    (["manifest", "--tool-call-parser", "qwen"], "'hermes'"),
])
def test_unknown_parser_names_are_one_line_listing_the_names(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and names in err, err


@pytest.mark.parametrize("argv,message", [
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (one of: deepseek_v3"),
    (["generate", "--prompt", "x", "--tools", "t.json"], "--tools needs --chat"),
    (["generate", "--prompt", "x", "--chat", "--tools", "/no/such/tools.json"], "--tools /no/such/tools.json: No such"),
    (["generate", "--prompt", "x", "--chat", "--tool-choice", "required"], "'tool_choice' 'required' needs 'tools'"),
])
def test_agent_flags_are_checked_before_anything_loads(argv, message, nothing_loads, capsys):
    code, err = run_main(argv, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags,message", [
    (["--min-replicas", "2"], "min_replicas needs max_replicas"),
    (["--max-replicas", "2", "--min-replicas", "3"], "need 1 <= min_replicas <= max_replicas"),
    (["--max-replicas", "2", "--min-replicas", "0"], "no scale to zero"),
    (["--max-replicas", "2", "-dp", "2"], "data_parallel_size 2 with max_replicas"),
    (["--max-replicas", "2", "--target-ongoing-requests", "0"], "target_ongoing_requests must be > 0"),
    (["--routing-load-margin", "-1"], "routing_load_margin must be >= 0"),
])
def test_scaling_and_routing_flags_are_checked_before_ray_starts(flags, message, nothing_loads, capsys):
    """Issue 28's flags of ``serve`` (and ``manifest``): one line, exit code 2, nothing started;
    argparse refuses a bad choice or port itself (usage, then one error line, exit code 2)."""
    for command in ("serve", "manifest"):
        code, err = run_main([command, "--model", "smollm2-135m-instruct"] + flags, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, (command, err)
    for bad, message in ((["--routing", "random"], "invalid choice: 'random'"),
                         (["--grpc-port", "70000"], "a TCP port is in [0, 65535]")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["serve"] + bad)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
