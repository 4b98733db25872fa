"""``benchmarks/kernels_gpu.py`` (the one-call GPU check of every kernel) stays runnable: its
``--cpu-interpret`` self-test runs every case on small shapes under the Triton interpreter and
compares each kernel with its torch reference, as it does on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ["rms_norm", "rotary", "silu_and_mul", "hadamard", "store_kv", "paged_attention decode",
       "paged_attention prefill", "mla decode", "mla sparse decode", "indexer decode", "indexer fp8-cache decode", "indexer prefill",
       "fused_moe", "gated_delta decode", "gated_delta chunked prefill", "causal_conv1d decode",
       "causal_conv1d prefill"]


def test_gpu_script_self_test_checks_every_kernel():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), "--cpu-interpret"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "kernels_gpu: 0 failure(s)" in lines[-1], proc.stdout
    for op in OPS:
        for dtype in ("float32", "bfloat16"):
            assert any(line.startswith("ok") and op in line and dtype in line for line in lines), (op, dtype)
