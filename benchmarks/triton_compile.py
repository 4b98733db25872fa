"""Compile every Triton kernel for a real GPU target on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``, how the CPU tests run the kernels) executes a
kernel's Python body directly, so it accepts code the compiler refuses: the first GPU run of
``benchmarks/gpu_check.sh`` failed every DSA model on a Hadamard kernel the interpreter had passed
for months (a ``tl.constexpr`` reassigned across ``tl.static_range`` stages). This script closes
that gap without a GPU:

1. ``--record FILE`` (a child process, interpreter on): runs the CPU cases of
   ``benchmarks/kernels_gpu.py`` (every kernel, fp32 and bf16) and records each launch: the
   kernel, each argument's Triton type (``*bf16``, ``i32``, ...), the constexpr values and
   ``num_warps`` / ``num_stages``.
2. Here (interpreter off): each distinct specialization goes through Triton's whole pipeline for
   the target (``--arch 90``: Hopper, TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas
   Triton ships), and its shared memory is checked against the target's per-block limit. Below
   sm_89 specializations with ``float8_e4m3fn`` operands are left out: Triton refuses e4m3 there,
   and such GPUs dequantize FP8 weights at load (:func:`workers.fp8.keeps_fp8`) and refuse the FP8
   indexer cache.

Arguments are specialized as Triton's launcher would (pointers 16-byte aligned and integers that are
multiples of 16 marked divisible), so the code compiled is what a GPU run of those shapes compiles.
Prints one row per kernel; exit 1 when anything fails to compile or needs too much shared memory,
2 when a launched kernel of ``kernels/`` was never recorded (the cases no longer cover it).

    .venv/bin/python benchmarks/triton_compile.py              # Hopper (sm_90)
    .venv/bin/python benchmarks/triton_compile.py --arch 80,90     # and Ampere (A100)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Largest dynamic shared memory of one block (bytes), by compute capability (CUDA guide, table 21).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _arg_type(value) -> str | None:
    """The Triton signature type of a runtime argument (``*bf16``, ``i32``, ...; Triton's own
    ``mangle_type``), None for what is passed as a constexpr."""
    from triton.runtime.jit import mangle_type

    if not (hasattr(value, "data_ptr") or isinstance(value, (int, float))):
        return None
    return mangle_type(value)


def _divisible(value) -> bool:
    """Whether Triton's launcher would specialize this argument as divisible by 16 (a pointer
    16-byte aligned, an integer multiple of 16): what lets the compiler vectorize accesses."""
    if hasattr(value, "data_ptr"):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _plain(value):
    """A constexpr value as JSON (triton's constexpr wrapper and torch/triton dtypes unwrapped)."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def record(path: str) -> None:
    """Run the kernel cases under the interpreter and write every distinct launch to ``path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(ROOT / "benchmarks")]
    import inspect

    from triton.runtime import interpreter

    from gpu_check_core import Report
    from kernels_gpu import run_kernel_checks

    launches: dict[str, dict] = {}
    original = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        annotations = {name: str(ann) for name, ann in fn.__annotations__.items()}
        signature, constexprs, divisible = {}, {}, []
        for name, value in bound.arguments.items():
            kind = None if "constexpr" in annotations.get(name, "") else _arg_type(value)
            signature[name] = kind or "constexpr"
            if kind is None:
                constexprs[name] = _plain(value)
            elif _divisible(value):
                divisible.append(name)
        entry = {"module": fn.__module__, "name": fn.__qualname__, "signature": signature,
                 "constexprs": constexprs, "options": options, "divisible": divisible}
        launches.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options)

    interpreter.InterpretedFunction.run = recording
    report = Report()
    run_kernel_checks(report, interpret=True)
    Path(path).write_text(json.dumps(list(launches.values())))
    failed = [r for r in report.results if r.status == "FAIL"]
    if failed:   # a kernel that is wrong on CPU is the kernel tests' business; say so here too
        print(f"triton_compile: {len(failed)} kernel case(s) failed under the interpreter", file=sys.stderr)


def compile_one(entry: dict, arch: int) -> dict:
    """Compile one recorded specialization for ``sm_<arch>``; its shared memory or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if arch < 89 and "*fp8e4nv" in entry["signature"].values():
        return {"ok": True, "skipped": True}   # never launched there: workers.fp8.keeps_fp8 dequantizes
    kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in entry["divisible"]}
    source = ASTSource(fn=kernel, signature=entry["signature"], constexprs=entry["constexprs"], attrs=attrs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=entry["options"])
    except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
        lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
        where = f"{lines[0]} ... " if len(lines) > 1 else ""          # "at 10:8:" ... the reason
        return {"ok": False, "error": f"{type(exc).__name__}: {where}{lines[-1].strip()}"}
    shared = compiled.metadata.shared
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and shared > limit:
        return {"ok": False, "error": f"needs {shared} bytes of shared memory, sm_{arch} allows {limit}"}
    return {"ok": True, "shared": shared}


def launched_kernels() -> set[str]:
    """Every ``name[grid](...)`` launch of a ``@triton.jit`` function in ``kernels/`` (module.name)."""
    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        text = path.read_text()
        jitted = set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+)", text))
        launched = set(re.findall(r"\b(\w+)\[\(", text)) | set(re.findall(r"\b(\w+)\[grid\]", text))
        found |= {f"shardserve.kernels.{path.stem}.{name}" for name in jitted & launched}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90", help="comma-separated compute capabilities (90: Hopper)")
    parser.add_argument("--record", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    args = parser.parse_args()
    if args.record:
        record(args.record)
        return 0
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launches.json"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        subprocess.run([sys.executable, __file__, "--record", str(out)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        entries = json.loads(out.read_text())
    os.environ.pop("TRITON_INTERPRET", None)   # the compiles (forked workers) import Triton without it
    archs = [int(a) for a in args.arch.split(",")]
    jobs = [(entry, arch) for arch in archs for entry in entries]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(compile_one, *zip(*jobs)))
    rows: dict[str, list] = {}
    for (entry, arch), result in zip(jobs, results):
        rows.setdefault(f"{entry['module'].rsplit('.', 1)[-1]}.{entry['name']} sm_{arch}", []).append((entry, result))
    failed = 0
    for name, items in sorted(rows.items()):
        bad = [(e, r) for e, r in items if not r["ok"]]
        shared = max((r.get("shared", 0) for _, r in items), default=0)
        skipped = sum(1 for _, r in items if r.get("skipped"))
        print(f"{'FAIL' if bad else 'PASS':4}  {name:60} {len(items) - skipped:3} specializations, "
              f"shared memory up to {shared / 1024:.1f} KiB"
              f"{f' ({skipped} with e4m3 operands not used below sm_89)' if skipped else ''}")
        for entry, result in bad[:3]:
            print(f"      constexprs {entry['constexprs']}: {result['error']}")
        failed += bool(bad)
    recorded = {f"{e['module']}.{e['name']}" for e in entries}
    missing = sorted(launched_kernels() - recorded)
    for name in missing:
        print(f"MISS  {name}: launched in kernels/ but no case of benchmarks/kernels_gpu.py ran it")
    print(f"triton_compile: {len(rows) - failed} of {len(rows)} kernels compiled for "
          f"{', '.join(f'sm_{a}' for a in archs)} ({len(jobs)} specializations, {time.time() - start:.0f} s)"
          f"{f'; {len(missing)} never launched' if missing else ''}")
    return 1 if failed else 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
