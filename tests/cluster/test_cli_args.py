"""The command line's contract without loading a model or starting Ray: every flag documents its
default and unit, bad arguments are one line and exit code 2 before anything loads, ``--stop``
escapes; and the front door's building blocks (API keys, bind warnings, TLS pairs)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.cluster import cli
from shardserve.cluster.frontend.security import FrontConfig, bearer_matches, is_loopback, load_api_keys, warn_if_exposed

# A numeric flag names its unit with one of these words (or is listed as unitless).
UNITS = ("token", "GiB", "second", "request", "sequence", "rank", "CPU", "GPU", "port", "replica", "keys", "pod")
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
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
])
def test_front_door_settings_are_checked_before_ray_starts(command, flags, message, nothing_loads, capsys):
    code, err = run_main([command, "--model", "smollm2-135m-instruct"] + flags, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_https_certificate_without_its_key_is_one_line_and_exit_2():
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "serve", "--ssl-certfile", "/etc/hostname"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr == "shardserve: error: --ssl-certfile needs --ssl-keyfile too\n"


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
    assert "k1" not in repr(FrontConfig(api_keys=["k1"]))   # never in a log line


def test_bearer_header_matching():
    keys = ["alpha", "beta"]
    assert bearer_matches("Bearer beta", keys) and bearer_matches("bearer alpha", keys)
    for header in (None, "", "beta", "Bearer", "Bearer bet", "Bearer betaa", "Basic beta", "Bearer \udc80"):
        assert not bearer_matches(header, keys), header


def test_non_loopback_binds_without_a_key_warn(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with caplog.at_level(logging.WARNING):
        assert warn_if_exposed("0.0.0.0", [], "the HTTP server")
        assert not warn_if_exposed("0.0.0.0", ["k"], "the HTTP server")
        assert not warn_if_exposed("127.0.0.1", [], "the HTTP server")
    assert len(caplog.records) == 1 and "without an API key" in caplog.records[0].getMessage()
    assert cli.build_parser().parse_args(["serve-grpc"]).host == "127.0.0.1"
    assert cli.build_parser().parse_args(["serve"]).host == "127.0.0.1"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--max-tokens", "abc"], ["serve", "--port", "99999"],
                                  ["serve-grpc", "--grpc-port", "-1"], ["serve", "--bogus-flag"], ["bogus"],
                                  ["serve", "--device", "tpu"]])
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
