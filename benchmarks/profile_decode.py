"""Where a batch-1 decode step's time goes (torch profiler), in this process, on SmolLM2.

Runs the single-process engine on one request, times ``--steps`` decode steps without the
profiler (wall ms per step, and the share inside ``ModelRunner.execute``), then profiles as many
again and groups the ATen ops' self time: packed matmuls, float matmuls, attention, the rest
(norms, RoPE, cache writes, indexing, casts). Python and dispatch overhead is the step time
that no op accounts for; then the ATen op calls per step (machine-independent, unlike the times).
``--attention-ab N`` then times the C decode attention against the torch ops (N interleaved pairs).
Run with ``make bench``; not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

GROUPS = {
    "packed matmul": ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm"),
    "float matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None, help="engine --dtype (default: the engine's default)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--compile", default="off", choices=["off", "auto", "on"], help="engine --compile")
    parser.add_argument("--attention-ab", type=int, default=0, metavar="ROUNDS",
                        help="then time ROUNDS pairs of decode runs, the C decode attention (kernels/cpu_attention.py) "
                             "against the torch ops (SHARDSERVE_KERNELS=torch), interleaved in this process")
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from shardserve.cluster.config import EngineArgs
    from shardserve.cluster.llm import LLM
    from shardserve.cluster.engine.request import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = {"dtype": args.dtype} if args.dtype else {}
    extra["compile"] = args.compile
    llm = LLM(EngineArgs(model=args.model, kv_cache_gib=0.05, **extra), progress=False)
    llm.core.add_request(llm.encode("The history of the Roman Empire"),
                         SamplingParams(max_tokens=3 * args.steps + 16, temperature=0, ignore_eos=True))
    for _ in range(8):
        llm.core.step()
    runner_s = []
    execute = llm.runner.execute

    def timed(plan):
        start = time.perf_counter()
        out = execute(plan)
        runner_s.append(time.perf_counter() - start)
        return out

    llm.runner.execute = timed
    start = time.perf_counter()
    for _ in range(args.steps):
        llm.core.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    llm.runner.execute = execute
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            llm.core.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
    grouped = {name: sum(e.self_cpu_time_total for e in events if e.key in ops) / args.steps / 1e3
               for name, ops in GROUPS.items()}
    grouped["other ops"] = total - sum(grouped.values())
    print(f"batch-1 decode step: {step_ms:.2f} ms ({sum(runner_s) / len(runner_s) * 1e3:.2f} ms in the runner), "
          f"{getattr(llm.runner, 'dtype', 'float32')}, {torch.get_num_threads()} threads, --compile {args.compile}")
    print(f"profiled ({args.steps} steps, per step): ATen ops {total:.2f} ms: "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in grouped.items()))
    calls = {e.key: e.count / args.steps for e in events if e.key.startswith("aten::")}
    print(f"ATen op calls per step (nested ones included; the same on any machine): {sum(calls.values()):.0f}, of "
          "which " + ", ".join(f"{name} {calls.get('aten::' + name, 0):.0f}" for name in ("copy_", "_to_copy", "index")))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    if args.attention_ab:
        attention_ab(llm, args.attention_ab, args.steps)


def attention_ab(llm, rounds: int, steps: int) -> None:
    """Batch-1 decode ms per step with the C decode attention and with the torch ops, ``rounds``
    pairs interleaved on one engine (separate processes differed by more than the effect)."""
    from shardserve.cluster.engine.request import SamplingParams

    times: dict[str, list[float]] = {"C kernel": [], "torch ops": []}
    for round_ in range(rounds):
        for name in times:
            if name == "torch ops":
                os.environ["SHARDSERVE_KERNELS"] = "torch"
            else:
                os.environ.pop("SHARDSERVE_KERNELS", None)
            llm.core.add_request(llm.encode(f"Story {round_}: once upon a time"),
                                 SamplingParams(max_tokens=steps + 24, temperature=0, ignore_eos=True))
            for _ in range(8):
                llm.core.step()
            start = time.perf_counter()
            for _ in range(steps):
                llm.core.step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
            while llm.core.has_unfinished():
                llm.core.step()
    os.environ.pop("SHARDSERVE_KERNELS", None)
    print("decode attention, batch-1 step (median ms of %d interleaved runs): " % rounds
          + ", ".join(f"{name} {statistics.median(ms):.2f}" for name, ms in times.items()))


if __name__ == "__main__":
    main()
