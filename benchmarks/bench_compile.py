"""What ``--compile`` costs and gives on this machine: start-up and decode CPU per step, eager vs
compiled, one run (the measurement behind ``--compile auto``, ``workers/compilation.py``).

Each mode runs in a fresh process of the single-process engine (``cluster/llm.py``, one torch
thread): start-up (import to a ready engine; compiled: with the compile cache as it is, so run it
twice to see a warm start), then ``--steps`` decode steps of batches of 1 and 8 greedy requests
after a few warm-up steps. CPU time (``time.process_time``) is what counts on a shared machine;
wall time is printed beside it. Ratios are compiled / eager, same run.

    .venv/bin/python benchmarks/bench_compile.py [--model smollm2-135m-instruct] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BATCHES = (1, 8)


def measure(model: str, mode: str, steps: int, kv_cache_gib: float) -> dict:
    """One mode in this process: ``{"startup_cpu_s", "startup_wall_s", "stats", "cpu_ms": {batch: ms/step},
    "wall_ms": {...}}``."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    import torch

    torch.set_num_threads(1)
    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.engine.request import SamplingParams
    from shardserve.cluster.llm import LLM
    from shardserve.workers.compilation import compile_stats

    llm = LLM(EngineArgs(model=model, kv_cache_gib=kv_cache_gib, compile=mode), progress=False)
    out = {"startup_cpu_s": time.process_time() - cpu0, "startup_wall_s": time.perf_counter() - wall0,
           "stats": compile_stats(), "cpu_ms": {}, "wall_ms": {}}
    for batch in BATCHES:
        for i in range(batch):
            llm.core.add_request(llm.encode(f"{i} The history of the Roman Empire"),
                                 SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True))
        for _ in range(6):   # prefill and the first decode steps
            llm.core.step()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            llm.core.step()
        out["cpu_ms"][batch] = 1e3 * (time.process_time() - cpu) / steps
        out["wall_ms"][batch] = 1e3 * (time.perf_counter() - wall) / steps
        while llm.core.has_unfinished():
            llm.core.step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per batch size")
    parser.add_argument("--kv-cache-gib", type=float, default=0.05)
    parser.add_argument("--modes", default="off,on", help="comma-separated --compile modes, one process each")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.steps, args.kv_cache_gib)))
        return
    results = {}
    for mode in args.modes.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--steps",
                               str(args.steps), "--kv-cache-gib", str(args.kv_cache_gib)],
                              capture_output=True, text=True, check=True)
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{'mode':6} {'start-up cpu s':>14} {'(wall s)':>9} " + " ".join(
        f"{f'batch {b} cpu ms/step':>20} {'(wall)':>8}" for b in BATCHES) + "  compile stats")
    for mode, r in results.items():
        print(f"{mode:6} {r['startup_cpu_s']:14.1f} {r['startup_wall_s']:9.1f} " + " ".join(
            f"{r['cpu_ms'][str(b)]:20.2f} {r['wall_ms'][str(b)]:8.1f}" for b in BATCHES) + f"  {r['stats']}")
    if "off" in results:
        base = results["off"]
        for mode, r in results.items():
            if mode != "off":
                print(f"{mode} / off: start-up cpu {r['startup_cpu_s'] / base['startup_cpu_s']:.2f}x, " + ", ".join(
                    f"batch {b} cpu/step {r['cpu_ms'][str(b)] / base['cpu_ms'][str(b)]:.2f}x" for b in BATCHES))


if __name__ == "__main__":
    main()
