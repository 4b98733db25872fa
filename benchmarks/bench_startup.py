"""Start-up time of ``shardserve generate``: seconds from process start to the first token, and
how much of it is spent parsing GGUF metadata.

Each repeat runs, in a fresh process,

    python -m shardserve.cluster.cli generate --model <gguf> --prompt hi --max-tokens 1

and times it from spawn to the line with the completion (one token: the first), wall and the child's
CPU seconds (``RUSAGE_CHILDREN``; the fairer figure on a shared machine). One more run under
``cProfile`` counts the GGUF parses: ``gguf.GGUFReader`` (decodes every metadata element, the
vocabulary included), transformers' metadata conversion ``load_gguf_checkpoint``, our header reader
(``workers/gguf_file.py``) and transformers' tokenizer-vocabulary reader, with their cumulative
seconds (profiled seconds are inflated: compare them with each other, not with the wall times).

Several interpreters may be compared in one run, each with its own checkout (an editable install):
``--python before=/work/main/.venv/bin/python --python after=.venv/bin/python``; the table gives
medians and the ratio to the first. Timings on a busy machine are noisy: compare within one run.

    .venv/bin/python benchmarks/bench_startup.py [--model smollm2-135m-instruct] [--repeats 3] \\
        [--python LABEL=PATH ...] [--no-profile]
"""

from __future__ import annotations

import argparse
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time

# (label, file suffix, function name) of the profiled functions that read GGUF metadata
PARSERS = (
    ("gguf.GGUFReader (full parse)", "gguf/gguf_reader.py", "__init__"),
    ("transformers load_gguf_checkpoint", "modeling_gguf_pytorch_utils.py", "load_gguf_checkpoint"),
    ("transformers get_gguf_tokenizer", "gguf_tokenizer_mapping.py", "get_gguf_tokenizer"),
    ("shardserve read_header (header only)", "workers/gguf_file.py", "_read_header"),
)
# callers whose cumulative time says where start-up goes
PHASES = (
    ("load_config", "workers/model_source.py", "load_config"),
    ("load_tokenizer", "cluster/tokenizer.py", "load_tokenizer"),
    ("ModelRunner.__init__", "workers/model_runner.py", "__init__"),
)


def command(python: str, model: str) -> list[str]:
    return [python, "-m", "shardserve.cluster.cli", "generate", "--model", model, "--prompt", "hi", "--max-tokens", "1"]


def time_to_first_token(python: str, model: str) -> tuple[float, float]:
    """``(wall seconds from spawn to the completion line, CPU seconds of the whole process)``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.Popen(command(python, model), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    line = proc.stdout.readline()
    wall = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0 or not line:
        raise RuntimeError(f"{' '.join(command(python, model))} failed (exit {proc.returncode})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def profile(python: str, model: str) -> dict[str, tuple[int, float]]:
    """``{label: (calls, cumulative seconds)}`` of :data:`PARSERS` and :data:`PHASES` in one profiled run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "startup.prof")
        args = command(python, model)
        subprocess.run([python, "-m", "cProfile", "-o", out, *args[1:]], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        stats = pstats.Stats(out).stats
    found = {}
    for label, suffix, func in PARSERS + PHASES:
        calls = seconds = 0
        for (file, _, name), (_, ncalls, _, cumtime, _) in stats.items():
            if name == func and file.endswith(suffix):
                calls, seconds = calls + ncalls, seconds + cumtime
        found[label] = (calls, seconds)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name, .gguf file or HF folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--python", action="append", default=[],
                        help="LABEL=PATH of an interpreter whose shardserve is measured (repeatable; default: this one)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run (parse counts)")
    args = parser.parse_args()
    from shardserve.workers.model_source import resolve_model

    model = str(resolve_model(args.model).path)   # fetched once here, not inside a timed run
    pythons = [tuple(spec.split("=", 1)) for spec in args.python] or [("this", sys.executable)]
    print(f"command: {' '.join(command('PYTHON', model))}")
    results = {}
    for rep in range(args.repeats):   # interleaved, so a burst of load on the machine hits every label
        for label, python in pythons:
            wall, cpu = time_to_first_token(python, model)
            results.setdefault(label, []).append((wall, cpu))
            print(f"  {label} run {rep + 1}: {wall:.2f} s to first token, {cpu:.2f} CPU s", flush=True)
    base = statistics.median(w for w, _ in results[pythons[0][0]])
    print(f"\n| {'interpreter':<10} | wall to 1st token, median s (runs) | CPU s, median | vs {pythons[0][0]} |")
    print("|---|---|---|---|")
    for label, _ in pythons:
        walls, cpus = [w for w, _ in results[label]], [c for _, c in results[label]]
        runs = ", ".join(f"{w:.1f}" for w in walls)
        print(f"| {label:<10} | {statistics.median(walls):.2f} ({runs}) | {statistics.median(cpus):.2f} | "
              f"{statistics.median(walls) / base:.2f}x |")
    if args.no_profile:
        return
    profiles = {label: profile(python, model) for label, python in pythons}
    print(f"\n| profiled (cProfile, inflated) | " + " | ".join(f"{label}: calls, cum s" for label, _ in pythons) + " |")
    print("|---|" + "---|" * len(pythons))
    for label, _, _ in PARSERS + PHASES:
        cells = " | ".join(f"{profiles[p][label][0]}, {profiles[p][label][1]:.2f}" for p, _ in pythons)
        print(f"| {label} | {cells} |")


if __name__ == "__main__":
    main()
