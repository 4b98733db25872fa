"""``benchmarks/gpu_check.sh`` (the one-call GPU check) stays runnable and decisive: ``--cpu-dry-run``
runs every section on CPU (kernels under the Triton interpreter, graphs through their replay stand-in
under the host-sync guard, the Ray worker group on CPU actors) and ends in a PASS / FAIL / NOT RUN
table; a check made to fail on purpose fails alone, the others still run, and the exit code says so.
The SmolLM2 parity check is skipped here to keep the suite's time (it loads the real model twice);
the GPU run does it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ["rms_norm+residual", "rotary interleaved", "rotary half-split", "silu_and_mul", "hadamard", "store_kv",
       "store_cache latent", "paged_attention decode", "paged_attention prefill",
       "mla sparse prefill", "mla expanded prefill", "mla decode", "mla sparse decode",
       "indexer decode", "indexer fp8-cache decode", "indexer fp8-cache fp8-q decode", "indexer prefill",
       "indexer fp8 prefill", "fused_moe", "fp8_linear", "fp8 fused_moe", "gated_delta decode",
       "gated_delta chunked prefill", "causal_conv1d decode", "causal_conv1d prefill"]
CHECKS = (["placement: llama", "placement: deepseek_v32", "placement: qwen3_next", "parity fp32: llama",
           "parity bf16: deepseek_v32", "parity fp8: V3.2 FP8 kept", "graphs: qwen3_next seeded sampling",
           "speculative: deepseek_v32 MTP k=2 greedy", "cluster: TP=1 WorkerGroup on cpu, async scheduling",
           "memory: KV budget", "layer: V3.2 (TP=1 rank) decode at 256 tokens, batch 4", "throughput: llama-shaped"]
          + [f"graphs: {arch} greedy" for arch in ("llama", "qwen3_next")])
NOT_RUN = {"parity: smollm2": "--skip", "nccl: 1-rank communicator": "no CUDA device",
           "nccl: multi-rank": "no CUDA device", "cluster: TP=2": "2 GPUs needed, 0 visible",
           "memory: real memory after KV allocation": "not written yet",
           "long context: prefill rows": "not ported yet"}


def run_check(*args: str, dry: bool = True) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Run the script; ``(exit code, {check name: (status, detail)} from the final table, output)``."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = ""       # no device, even on a GPU machine
    command = ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *(["--cpu-dry-run"] if dry else []), *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    output = proc.stdout + proc.stderr
    table = proc.stdout.split("\n== summary", 1)[-1]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"(PASS|FAIL|NOT RUN) +(.+?)(?: {2,}(.*))?$", line)
        if match:
            rows[match.group(2).strip()] = (match.group(1), match.group(3) or "")
    return proc.returncode, rows, output


def status(rows: dict, prefix: str) -> list[str]:
    return [state for name, (state, _) in rows.items() if name.startswith(prefix)]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.extended   # ~5 min: every section's kernels, also checked one by one in tests/kernels
@pytest.mark.timeout(1500)
def test_gpu_check_dry_run_passes_every_section():
    code, rows, output = run_check("--skip", "smollm2")
    assert code == 0 and "FAIL" not in {state for state, _ in rows.values()}, output[-6000:]
    for op in OPS:
        for dtype in ("float32", "bfloat16"):
            states = [s for name, (s, _) in rows.items() if name.startswith(f"kernel: {op} ") and name.endswith(dtype)]
            captured = status(rows, f"kernel: {op} ") and [
                s for name, (s, _) in rows.items() if name.startswith(f"kernel: {op} ") and name.endswith(
                    f"{dtype} captured")]
            assert states and set(states) == {"PASS"} and set(captured) == {"PASS"}, (op, dtype, states, captured)
    for check in CHECKS:
        assert status(rows, check) and set(status(rows, check)) == {"PASS"}, (check, status(rows, check))
    for check, reason in NOT_RUN.items():     # never counted as passed, and said why
        hits = [(s, detail) for name, (s, detail) in rows.items() if name.startswith(check)]
        assert hits and all(s == "NOT RUN" and reason in detail for s, detail in hits), (check, hits)
    last = [line for line in output.strip().splitlines() if line.startswith("gpu_check:")][-1]   # (Ray may warn after it)
    assert re.search(r"gpu_check: \d+ PASS, 0 FAIL, 6 NOT RUN \(not counted as passed\)", last), last


def test_a_failing_check_hides_nothing():
    """One check of the layer section fails on purpose (an exception where it records its result):
    it alone is FAIL, the section's next check and the section after it still PASS, exit code 1."""
    failing = "layer: V3.2 (TP=1 rank) decode at 256 tokens, batch 1"
    code, rows, output = run_check("--only", "layer,memory", "--inject-failure", failing)
    assert code == 1, output[-4000:]
    assert rows[failing][0] == "FAIL" and "InjectedFailure" in rows[failing][1], output[-4000:]
    assert rows["layer: V3.2 (TP=1 rank) decode at 256 tokens, batch 4"][0] == "PASS", output[-4000:]
    assert status(rows, "memory: KV budget") == ["PASS"], output[-4000:]
    assert "gpu_check: 2 PASS, 1 FAIL, 0 NOT RUN" in output


def test_without_cuda_every_section_is_not_run():
    """No CUDA device and no ``--cpu-dry-run``: nothing is counted as passed, every section is listed
    NOT RUN with the reason, and the exit code is 2 (the environment cannot run it)."""
    code, rows, output = run_check(dry=False)
    assert code == 2, output[-4000:]
    assert rows and {state for state, _ in rows.values()} == {"NOT RUN"}, output[-4000:]
    assert all("no CUDA device visible" in detail for _, detail in rows.values()), rows
    for title in ("kernels: every Triton kernel", "graphs: captured decode", "cluster: the Ray worker group"):
        assert status(rows, title) == ["NOT RUN"], (title, rows)
    assert output.strip().splitlines()[-1].startswith("gpu_check: NOT RUN: no CUDA device visible"), output[-2000:]
