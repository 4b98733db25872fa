"""Decode step time, TP=1 vs TP=2 on this machine, split into compute, all-reduce and dispatch.

Each configuration serves SmolLM2 on a local Ray cluster and decodes one request (batch 1) for
``--new-tokens`` tokens. Per step: ``step`` is the coordinator's time per step (with actor calls,
which run async scheduling, the interval between two results; with a compiled graph the round
trip to all ranks), ``collective`` rank 0's time inside all-reduce / all-gather, ``compute`` the
rest of rank 0's execute, ``dispatch`` = step - execute (what async scheduling does not hide:
Ray's task handling on the rank, or the compiled-graph channel overhead).
Run with ``make bench``; not a test.
"""

from __future__ import annotations

import argparse

import ray

from shardserve.cluster.config import EngineArgs
from shardserve.cluster.replica.coordinator import launch_coordinator, stop_coordinator
from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.replica.worker_group import GroupConfig

CONFIGS = [  # (tp, collective, dispatch)
    (1, None, "calls"), (1, None, "compiled"),
    (2, "shm", "calls"), (2, "shm", "compiled"), (2, "gloo", "calls"),
]


def measure(model: str, tp: int, collective: str | None, dispatch: str, new_tokens: int) -> dict:
    cpus = 2.0 if tp == 1 else 1.0
    handle, pg = launch_coordinator(EngineArgs(model=model, tensor_parallel_size=tp, kv_cache_gib=0.05),
                                    GroupConfig(cpus_per_worker=cpus, collective=collective, dispatch=dispatch))
    try:
        prompt = ray.get(handle.encode.remote(text="The history of the Roman Empire"))
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ray.get(handle.complete.remote(prompt, SamplingParams(max_tokens=4, temperature=0.0)))  # warm-up
        ray.get(handle.take_step_stats.remote())
        ray.get(handle.complete.remote(prompt, params))
        stats = ray.get(handle.take_step_stats.remote())
    finally:
        stop_coordinator(handle, pg)
    steps = stats["steps"]
    return {key: stats[key] / steps * 1e3 for key in ("step_s", "execute_s", "collective_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    from shardserve.workers.model_source import resolve_model

    model = str(resolve_model(args.model).path)
    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        print(f"{'TP':>2} {'collective':>10} {'dispatch':>9} | {'step ms':>8} {'compute':>8} {'all-reduce':>10} "
              f"{'dispatch':>8} | {'vs TP=1':>7}")
        base = None
        for tp, collective, dispatch in CONFIGS:
            row = measure(model, tp, collective, dispatch, args.new_tokens)
            base = base or row["step_s"]
            print(f"{tp:>2} {collective or '-':>10} {dispatch:>9} | {row['step_s']:>8.2f} "
                  f"{row['execute_s'] - row['collective_s']:>8.2f} {row['collective_s']:>10.2f} "
                  f"{row['step_s'] - row['execute_s']:>8.2f} | {base / row['step_s']:>6.2f}x", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
