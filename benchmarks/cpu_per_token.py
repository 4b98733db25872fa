"""CPU time per generated token, by process: where a 1-client stream's CPU goes, shardserve beside
llama-server on the same GGUF, in one run.

On a machine with few cores every process that burns CPU while rank 0 computes a decode step
takes cores away from the rank's matmul threads, so the time per output token grows with the
CPU the other processes spend. This benchmark starts each server (``shardserve serve`` at TP=1
and TP=2, then ``llama-server``; helpers from ``bench_serving.py``), sends ``--num-requests``
streaming completions of ``--max-tokens`` tokens one after the other (``--concurrency C``: from C
clients at once, where batching across requests shows), and prints, per process of
the server's tree (Ray actors by name), the user + system CPU it used divided by the tokens
generated (ms/token; from ``/proc/PID/stat``), beside the wall time per token. Background work
(Ray's GCS, dashboard, Serve controller) is included: it is CPU the ranks do not get. Beside each
figure, in parentheses: what the process burns with no request at all (measured for ``--idle-s``
seconds before the load), at that rate over the load's wall time per token: the part that does not
grow with the tokens.
Numbers are printed, never asserted; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_serving as bs  # noqa: E402

from shardserve.cluster.ports import unused_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[str, float] | None:
    """``(name, user + system CPU seconds)`` of a live process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    name = argv[0].decode(errors="replace")
    if not name.startswith("ray::"):   # Ray actors name themselves; others by program (and script)
        words = [Path(a.decode(errors="replace")).name for a in argv if a and not a.startswith(b"-")]
        name = " ".join(words[:2] if words and words[0].startswith("python") else words[:1])
    return name.split(".")[0] if name.startswith("ray::") else name, (int(fields[11]) + int(fields[12])) / TICKS


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    return {pid: got for pid in [root, *bs.descendants(root)] if (got := cpu_seconds(pid))}


def cpu_used(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each process name used between two :func:`tree_cpu` snapshots."""
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used[name] = used.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return used


def measure(server: bs.Server, num_requests: int, max_tokens: int, concurrency: int = 1, idle_s: float = 10.0) -> None:
    asyncio.run(bs.run_load(server.base_url, server.name, 1, 2, max_tokens))   # warm-up
    before = tree_cpu(server.proc.pid)
    time.sleep(idle_s)   # what the same processes burn with no request at all (their own loops)
    idle = cpu_used(before, tree_cpu(server.proc.pid))
    before, start = tree_cpu(server.proc.pid), time.monotonic()
    result = asyncio.run(bs.run_load(server.base_url, server.name, concurrency, num_requests, max_tokens,
                                     prompts=bs.distinct_prompts(num_requests, first=2)))   # not the warm-up's
    after, wall = tree_cpu(server.proc.pid), time.monotonic() - start
    tokens = max(1, result.output_tokens)
    used = cpu_used(before, after)
    # idle: the process's idle CPU rate over the load's wall time, per token (background that does
    # not grow with tokens); the rest came with the requests
    idle_per_token = {name: 1000 * idle.get(name, 0.0) / idle_s * wall / tokens for name in used}
    print(f"\n{server.name}, {concurrency} client(s): {tokens} tokens, wall {1000 * wall / tokens:.2f} ms/token, "
          f"TPOT p50 {1000 * bs.percentile(result.tpot_s, 50):.2f} ms, "
          f"CPU {1000 * sum(used.values()) / tokens:.2f} ms/token in all "
          f"(of which {sum(idle_per_token.values()):.2f} at the idle rate of {idle_s:g} s before)")
    print("  ms/token  (at idle rate)  process")
    for name, seconds in sorted(used.items(), key=lambda item: -item[1]):
        if seconds * 1000 / tokens >= 0.05:
            print(f"  {1000 * seconds / tokens:8.2f}  ({idle_per_token[name]:5.2f})        {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default="smollm2-135m-instruct", help="GGUF file or known model name")
    parser.add_argument("--num-requests", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=1, help="clients sending at once (default 1)")
    parser.add_argument("--compile", default="auto", choices=["off", "auto", "on"], help="`shardserve serve --compile`")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured before the load")
    parser.add_argument("--servers", default="tp1,tp2,llama", help="subset of tp1,tp2,llama")
    parser.add_argument("--shardserve-args", default="", help="extra `shardserve serve` flags")
    parser.add_argument("--dispatch", default="calls,calls", help="`--dispatch` of TP=1 and of TP=2")
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    from llama_server import llama_server_path

    from shardserve.workers.model_source import resolve_model

    gguf = resolve_model(args.gguf).path
    servers = args.servers.split(",")
    bs.warn_if_busy()
    print(f"{gguf.name}: {args.concurrency} client(s), {args.num_requests} streamed completions of {args.max_tokens} tokens, "
          f"{os.cpu_count()} CPUs (noisy on a shared machine)")
    dispatch = dict(zip((1, 2), args.dispatch.split(",")))
    for tp in (1, 2):   # one server at a time: each has the machine to itself
        if f"tp{tp}" in servers:
            extra = ["--dispatch", dispatch[tp], "--compile", args.compile, *args.shardserve_args.split()]
            _run(bs.shardserve_server(gguf, tp, unused_port(), Path(args.log_dir) / f"cpu_per_token_tp{tp}.log",
                                      extra, 0.25), args)
    if "llama" in servers:
        _run(bs.llama_server(llama_server_path(), gguf, unused_port(), Path(args.log_dir) / "cpu_per_token_llama.log",
                             max(1, args.concurrency), 4096), args)


def _run(server: bs.Server, args) -> None:
    try:
        server.wait_ready(900)
        measure(server, args.num_requests, args.max_tokens, args.concurrency, args.idle_s)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
