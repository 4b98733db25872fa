"""The harness of ``benchmarks/gpu_check.py``: results, the run's context, the section registry."""

from __future__ import annotations

import contextlib
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Spec-sheet HBM bandwidth (bytes/s) by device-name substring; the measured copy bandwidth is printed too.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.039e12, "A800": 2.039e12,
                 "L40S": 0.864e12, "A10G": 0.6e12, "4090": 1.008e12, "B200": 8.0e12}
PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
# Sections whose code another piece of work brings: key -> (title, reason). Each becomes one
# @section function when that code lands.
PENDING = {
    "memory-plan": ("memory: real memory after KV allocation and capture vs the plan",
                    "not written yet: workers/plan.py landed; the runner's check_memory_held does it at start-up"),
    "long-context": ("long context: prefill rows at 32K-160K tokens",
                     "not ported yet: main's long_context check (bench_long_context.py) into this harness"),
}


def _row(status: str, name: str, detail: str) -> str:
    """One table line; two spaces at least between the name and the detail (what parsers split on)."""
    return f"{status:<8} {name:<58}  {detail}".rstrip()


class InjectedFailure(RuntimeError):
    """Raised by ``--inject-failure`` (tests of the harness)."""


@dataclass(slots=True)
class Result:
    status: str     # PASS / FAIL / NOT RUN
    name: str
    detail: str


class Report:
    """Collects results; every check runs in its own :meth:`attempt` so one failure hides nothing.

    Args:
        inject: names of attempts that fail on purpose (``--inject-failure``).
    """

    def __init__(self, inject: set[str] | None = None) -> None:
        self.results: list[Result] = []
        self.inject = inject or set()
        self.start = time.time()

    def _add(self, status: str, name: str, detail: str = "") -> None:
        self.results.append(Result(status, name, detail))
        print(_row(status, name, detail), flush=True)

    def check(self, ok: bool, name: str, detail: str = "") -> None:
        if name in self.inject:   # an exception where the check is recorded: its attempt reports it
            raise InjectedFailure(f"--inject-failure {name!r}")
        self._add(PASS if ok else FAIL, name, detail)

    def not_run(self, name: str, reason: str) -> None:
        self._add(NOT_RUN, name, reason)

    def info(self, name: str, detail: str) -> None:
        """A measurement (printed, not in the table's counts)."""
        print(_row("info", name, detail), flush=True)

    @contextlib.contextmanager
    def attempt(self, name: str):
        """Run the block; an exception in it is this attempt's FAIL (with its reason), not the run's."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - report and run the rest
            traceback.print_exc()
            self._add(FAIL, name, f"{type(exc).__name__}: {str(exc)[:300]}")

    def summary(self) -> int:
        """Print the final table; the exit code (1 when anything failed)."""
        counts = {status: sum(r.status == status for r in self.results) for status in (PASS, FAIL, NOT_RUN)}
        print(f"\n== summary ({time.time() - self.start:.0f} s)")
        for status in (FAIL, NOT_RUN, PASS):
            for r in self.results:
                if r.status == status:
                    print(_row(r.status, r.name, r.detail))
        print(f"gpu_check: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[NOT_RUN]} NOT RUN (not counted as "
              f"passed) in {time.time() - self.start:.0f} s", flush=True)
        return 1 if counts[FAIL] else 0


@dataclass
class Context:
    """What every section gets: where it runs and the shared tiny checkpoints."""

    device: str                    # "cuda" or "cpu" (dry run)
    quick: bool
    skip: set = field(default_factory=set)   # --skip: section keys and sub-check names (e.g. smollm2)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpu_check_")))
    _tiny: dict = field(default_factory=dict)

    @property
    def dry(self) -> bool:
        return self.device != "cuda"

    @property
    def graphs(self) -> str:
        """The runner's ``decode_graphs`` setting that captures (CUDA) or stands in (CPU)."""
        return "auto" if self.device == "cuda" else "replay"

    def tiny(self, arch: str, **kwargs):
        """``(folder, transformers model)`` of a tiny checkpoint, written once per run; ``kwargs``:
        ``tokenizer=True`` (the engine's front end), ``mtp=True`` (one MTP layer)."""
        from tiny_checkpoints import write_tiny_checkpoint, write_tiny_llama

        key = (arch, tuple(sorted(kwargs.items())))
        if key not in self._tiny:
            path = self.root / "-".join([arch, *(name for name, on in sorted(kwargs.items()) if on)])
            hf = (write_tiny_llama(path, **kwargs) if arch == "llama"
                  else write_tiny_checkpoint(arch, path, seed=0, **kwargs))
            self._tiny[key] = path, hf
        return self._tiny[key]

    def smollm2(self):
        """The SmolLM2 GGUF files when in the cache (``benchmarks/gpu_prepare.sh``), else None."""
        from shardserve.workers.model_source import KNOWN_MODELS, cache_dir, resolve_model

        name = "smollm2-135m-instruct"
        if not (cache_dir() / name / Path(KNOWN_MODELS[name][1]).name).is_file():
            return None
        return resolve_model(name)

    def hbm_bandwidth(self) -> float | None:
        """Spec HBM bandwidth of this GPU (bytes/s), None when unknown or on CPU."""
        if self.dry:
            return None
        name = torch.cuda.get_device_name()
        return next((bw for key, bw in HBM_BANDWIDTH.items() if key in name), None)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


SECTIONS: list[tuple[str, str, object]] = []   # (key, title, fn) in run order


def section(key: str, title: str):
    """Register ``fn(ctx, report)`` as a section (run in registration order)."""

    def register(fn):
        SECTIONS.append((key, title, fn))
        return fn

    return register
