"""Everything GPU-side in one run (``benchmarks/gpu_check.sh``), decisive: every model and check in
its own try block, and a final table of PASS / FAIL / NOT RUN with the reason. NOT RUN is never a
pass (a 1-GPU machine reports "multi-rank NCCL: NOT RUN, 1 GPU visible", not a 1-rank identity).

Sections, in the order they run (the long timings last, so a run cut by the time budget still
reports the checks):

- placement: tiny Llama / DeepSeek-V3.2 runners on the GPU; no tensor off it after graphed decode.
- parity: tiny Llama / DeepSeek-V3 / V3.2 / GLM-5 / Qwen3-Next vs transformers (fp32 exact tokens,
  bf16 within the reference's own bf16 error); V3.2 FP8 kept in FP8; SmolLM2 bf16.
- nccl: the CuPy NCCL communicator (1 rank, eager + captured); multi-rank when 2 GPUs are visible.
- graphs: greedy decode from captured CUDA graphs == eager, per model family (Qwen3-Next included);
  seeded sampled decoding from graphs == eager; the host time of a captured step.
- speculative: tiny DeepSeek-V3.2 with its MTP layer, greedy with 2 draft tokens == no speculation.
- cluster: the Ray worker group on the GPU through a coordinator with async scheduling on (TP=1;
  TP=2 when 2 GPUs are visible) == the single-process engine.
- memory: the KV budget of ``--gpu-memory-utilization``; real memory against the plan (pending).
- layer: a DeepSeek-V3.2-shaped decoder layer (one TP=8 rank's shard) at 32K context, decode step time.
- long context: prefill rows (pending).
- kernels: every Triton kernel == its torch reference, captured in a CUDA graph and replayed ==
  eager, timed at serving shapes with its achieved fraction of HBM bandwidth.
- throughput: batch 1 / 32 / 256 decode tok/s (SmolLM2, a 1.2B Llama shape) and HBM fraction.

``--cpu-dry-run`` runs the same code on the CPU: kernels under the Triton interpreter on small
shapes, CUDA graphs through their replay stand-in (run under ``workers/sync_guard.py``'s guard, so a
host sync fails as a capture would), Ray on CPU actors; numbers printed there mean nothing.

Adding a section is one function: ``@section("key", "title")`` on ``fn(ctx, report)``; inside, one
``with report.attempt("name"):`` per model or check. A section waiting for code that has not landed
is listed in :data:`PENDING` (reported NOT RUN with its reason) until its function is written.

Exit code: 0 when nothing failed, 1 when something did, 2 when the environment cannot run it (no CUDA
device without ``--cpu-dry-run``: every section is listed NOT RUN and the last line says so).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check_core import PENDING, SECTIONS, Context, Report  # noqa: E402


def _load_sections() -> None:
    import gpu_check_models  # noqa: F401 - registers placement, parity, nccl, graphs, speculative, memory
    import gpu_check_cluster  # noqa: F401 - registers cluster
    import gpu_check_layer  # noqa: F401 - registers layer
    import kernels_gpu  # noqa: F401 - registers kernels
    import gpu_check_throughput  # noqa: F401 - registers throughput


def _no_device() -> int:
    """Without a CUDA device nothing GPU-side ran: every section is NOT RUN (never a pass), exit 2."""
    _load_sections()
    report = Report()
    reason = "no CUDA device visible"
    for _, title, _ in SECTIONS:
        report.not_run(title, reason)
    for title, _ in PENDING.values():
        report.not_run(title, reason)
    report.summary()
    print(f"gpu_check: NOT RUN: {reason} (torch {torch.__version__}, CUDA build {torch.version.cuda}); run it "
          "on a GPU machine, or pass --cpu-dry-run to exercise the same code on the CPU", flush=True)
    return 2


def run(args) -> int:
    dry = args.cpu_dry_run
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported (kernel section)
    elif not torch.cuda.is_available():
        return _no_device()
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    print(f"gpu_check: {'CPU dry run' if dry else torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{torch.cuda.device_count() if not dry else 0} GPU(s)", flush=True)
    _load_sections()
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    report = Report(set(args.inject_failure))
    ctx = Context("cpu" if dry else "cuda", args.quick, skip)
    order = [key for key, _, _ in SECTIONS]
    for key, (title, reason) in PENDING.items():
        if not only or key in only:
            report.not_run(title, reason)
    for key, title, fn in SECTIONS:
        if only and key not in only:
            continue
        if key in skip or (args.quick and key == "throughput"):
            report.not_run(title, "--skip" if key in skip else "--quick")
            continue
        if time.time() - report.start > args.budget_s:
            report.not_run(title, f"the time budget ({args.budget_s:.0f} s) was used up by the sections before")
            continue
        print(f"== {title} ({time.time() - report.start:.0f} s)", flush=True)
        with report.attempt(f"{key}: section"):
            fn(ctx, report)
        if not dry:
            torch.cuda.empty_cache()
    assert not (only - set(order) - set(PENDING)), f"unknown sections {only - set(order)}; known: {order}"
    return report.summary()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the same checks on the CPU (see the docstring)")
    parser.add_argument("--quick", action="store_true", help="no timed bf16 kernel cases and no throughput table")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip (reported NOT RUN)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (the others are left out)")
    parser.add_argument("--inject-failure", action="append", default=[], metavar="CHECK",
                        help="a check name that fails on purpose (tests of this harness; repeatable)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="sections starting after this many seconds are reported NOT RUN "
                             "(default $GPU_CHECK_BUDGET_S or 420 on a GPU, no limit in a dry run)")
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = float(os.environ.get("GPU_CHECK_BUDGET_S", "inf" if args.cpu_dry_run else 420))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
