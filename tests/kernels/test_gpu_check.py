"""``benchmarks/gpu_check.sh`` (the one-call GPU check) stays runnable: ``--cpu-dry-run`` runs the
same script on CPU (kernels under the Triton interpreter, graphs through their eager stand-in, the
memory profile's forward unmeasured) and every section reports ok. The SmolLM2 parity section is
skipped here to keep the suite's time (it loads the real model twice); the GPU run does it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ["rms_norm", "rotary", "silu_and_mul", "hadamard", "store_kv", "paged_attention decode", "mla sparse prefill",
       "mla expanded prefill",
       "paged_attention prefill", "mla decode", "mla sparse decode", "indexer decode", "indexer fp8-cache decode",
       "indexer prefill", "fused_moe", "fp8_linear", "fp8 fused_moe", "gated_delta decode", "gated_delta chunked prefill",
       "causal_conv1d decode", "causal_conv1d prefill"]
CHECKS = ["kernels: every Triton kernel", "placement: llama on cpu", "placement: deepseek_v32 on cpu",
          "parity fp32: llama", "parity bf16: deepseek_v32", "parity fp8: V3.2 FP8 kept", "graphs: llama decode",
          "graphs: deepseek_v32 decode", "memory: profiling forward ran"]


def test_gpu_check_dry_run_passes_every_section():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run", "--skip", "smollm2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "gpu_check: 0 failure(s)" in lines[-1], proc.stdout[-4000:]
    for op in OPS:
        for dtype in ("float32", "bfloat16"):
            assert any(line.startswith("ok") and op in line and dtype in line for line in lines), (op, dtype)
    for check in CHECKS:
        assert any(line.startswith("ok") and check in line for line in lines), check
    assert any(line.startswith("SKIP nccl") for line in lines)
    assert any(line.startswith("info decode llama-shaped tiny bf16 batch 8") for line in lines)
