"""Compiled forward (``--compile``): the model's layers between attention and collectives through
``torch.compile`` (Inductor: C++/OpenMP kernels on CPU, Triton on CUDA), one graph for every
token count, cached on disk.

What stays opaque (never traced, never fused; vLLM's piecewise rule): every attention block
(cache writes, paged / MLA / DSA attention, the gated-DeltaNet recurrence), routed MoE experts
(data-dependent routing) and the collectives. A layer marks such a call with :func:`opaque_call`:
eager it is a plain method call; while Dynamo traces, it becomes one call of the custom op
``shardserve::opaque`` that names the module by a key, so its caches and the step's attention
metadata (``workers/forward_context.py``) stay out of the graph. Collectives go through
:func:`tp_all_reduce` (``shardserve::all_reduce``). Packed int4/int8 and FP8 matmuls are ATen or
Triton calls that Inductor leaves as external calls. Everything else (norms, RoPE, SwiGLU,
residual adds, routers, casts, views) is fused by Inductor.

Shapes: the token count ``T`` (dim 0 of ``input_ids`` and ``positions``) is dynamic, so one
compile serves prefill, decode, mixed and verify steps of any batch (tests count compiles). The
first trace runs at ``T = 2`` (Dynamo specializes sizes 0 and 1); a batch-1 decode (``T = 1``)
runs the same graph: :class:`CompiledForward` calls the compiled code without Dynamo's guards
(vLLM's custom dispatcher), since nothing in the graph depends on more than the parameters'
shapes and ``T``.

Disk cache: the whole compiled forward (Dynamo's ahead-of-time API, ``aot_compile``: its
transformed bytecode and Inductor's kernels in one file) is saved under
``$SHARDSERVE_CACHE/inductor``, keyed by :func:`forward_key` (model structure, parameter shapes and
dtypes, config, TP place, thread count, CPU vector ISA, torch version, shardserve's layer and kernel
sources). A later start-up with the same key loads it, on a thread started before the weights load,
instead of tracing: no Dynamo trace, no kernel build (:func:`compile_stats` tells which happened).
A new key (another model, a shardserve or torch upgrade) compiles anew; the 16 most recently used
are kept. A cache folder that cannot be written leaves Inductor a temporary one (nothing is kept).

``--compile auto`` compiles where it was measured to pay (``benchmarks/bench_compile.py``): CPU
ranks. On the 2-core development machine (SmolLM2-135M Q4_1, one thread, one run) the compiled
forward cut decode CPU per step by 21-22% at batch 1 and 10-12% at batch 8; start-up with the
saved forward: 3.8-3.9 s of CPU against 2.6-2.7 s eager (the ~1.2 s: importing Dynamo's and
Inductor's runtime, probing the CPU's vector ISAs, the read), ~20 s the first time. CUDA ranks are
not compiled under ``auto`` (not measured yet; their decode graphs already remove the launch
cost). With ``on`` the decode graphs (``workers/cuda_graphs.py``) capture the compiled forward,
and prefill / verify steps run it outside a graph.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from shardserve.kernels.ops import define_op
from shardserve.workers.distributed import get_tp_group
from shardserve.workers.model_source import cache_dir as shardserve_cache
from shardserve.workers.model_source import keep_newest, mark_used

logger = logging.getLogger(__name__)

COMPILE_MODES = ("off", "auto", "on")

# NOTE: the modules of the forward that runs now, by qualified name (set by CompiledForward for
# the duration of a call: tracing, running the compiled code, capturing it in a CUDA graph). The
# custom op's arguments can only be tensors, numbers and strings, so it names its module; names
# (not ids) keep the graph, hence the on-disk cache key, the same from one process to the next.
_ACTIVE_MODULES: dict[str, nn.Module] = {}


def _opaque(inputs: list[torch.Tensor], name: str, args: list[int]) -> list[torch.Tensor]:
    # NOTE: the call may write the module's caches (KV, latent, indexer, recurrent state): they
    # are not graph values, and nothing else in the graph reads them, so order is preserved.
    # Outputs are made contiguous, the strides the fakes promise and the compiled code reads by
    # (MLA's attention returns a [T, H, D] view of [H, T, D]; contiguous() is free otherwise).
    return [out.contiguous() for out in _ACTIVE_MODULES[name].opaque_forward(*inputs, *args)]


def _opaque_fake(inputs: list[torch.Tensor], name: str, args: list[int]) -> list[torch.Tensor]:
    return list(_ACTIVE_MODULES[name].opaque_fake(*inputs, *args))


define_op("opaque(Tensor[] inputs, str name, int[] args) -> Tensor[]", _opaque, _opaque_fake)


def opaque_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule of ``model`` with an ``opaque_forward``, by qualified name (set as its
    ``opaque_name``)."""
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "opaque_forward"):
            module.opaque_name = name
            found[name] = module
    return found


def opaque_call(module: nn.Module, inputs: Sequence[torch.Tensor], args: Sequence[int] = ()) -> list[torch.Tensor]:
    """``module.opaque_forward(*inputs, *args)`` as a list of tensors; an opaque custom op while
    Dynamo traces (``args``: Python ints, constants of the graph).

    The module implements ``opaque_forward(*inputs, *args) -> sequence of new tensors`` (never
    views of its inputs) and ``opaque_fake(*inputs, *args)``: empty tensors of the same shapes and
    dtypes, built from the inputs' sizes so that the token count stays symbolic.
    """
    if torch.compiler.is_compiling():
        return torch.ops.shardserve.opaque(list(inputs), module.opaque_name, list(args))
    return list(module.opaque_forward(*inputs, *args))


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    # gloo and NCCL reduce in place: work on a copy, a custom op must not return its input
    return get_tp_group().all_reduce(tensor.clone())


define_op("all_reduce(Tensor tensor) -> Tensor", _all_reduce, torch.empty_like)


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the TP group (identity at ``tp_size == 1``); opaque while Dynamo traces."""
    group = get_tp_group()
    if group.tp_size == 1:
        return tensor
    if torch.compiler.is_compiling():
        return torch.ops.shardserve.all_reduce(tensor)
    return group.all_reduce(tensor)


COMPILED_FORWARDS_KEPT = 16   # compiled forwards kept on disk (the least recently used beyond are removed)


def cache_dir() -> Path:
    """Where compiled forwards are kept: ``$SHARDSERVE_CACHE/inductor`` (default
    ``~/.cache/shardserve/inductor``)."""
    return shardserve_cache() / "inductor"


_scratch_dir: str | None = None


def _point_inductor_at_cache() -> None:
    """Point Inductor's own caches (``TORCHINDUCTOR_CACHE_DIR``, unless it is set) at
    :func:`cache_dir`, or, where that cannot be written (a read-only volume, another user's
    cache), at a temporary folder of this process, with a warning: Inductor writes kernels and
    lock files there even to load a compiled forward, and failed at start-up without it."""
    global _scratch_dir
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        if _scratch_dir is None:
            _scratch_dir = tempfile.mkdtemp(prefix="shardserve-inductor-")
            logger.warning("the compile cache %s cannot be written: compiled kernels go to %s and are not kept "
                           "for the next start-up", path, _scratch_dir)
        path = Path(_scratch_dir)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def use_compile(mode: str, device: torch.device) -> bool:
    """Whether a rank on ``device`` compiles its forward under ``--compile mode``.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile {mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    if mode == "auto":
        return device.type == "cpu"
    return mode == "on"


def compile_stats() -> dict[str, int]:
    """Counters of this process's compiles: ``traces`` (Dynamo frames compiled), ``cache_hits`` /
    ``cache_misses`` (Inductor FX-graph cache: a miss generated and built kernels), ``loads``
    (compiled forwards read whole from the disk cache: no trace, no kernel build)."""
    from torch._dynamo.utils import counters

    return {"traces": int(counters["stats"]["unique_graphs"]),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "loads": _LOADS}


_LOADS = 0


@functools.cache
def _source_digest() -> str:
    """sha256 of shardserve's ``workers`` and ``kernels`` sources: the code Dynamo traces (a changed
    layer must not run a stale compiled forward)."""
    import shardserve.kernels
    import shardserve.workers

    digest = hashlib.sha256()
    for package in (shardserve.workers, shardserve.kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def forward_key(model: nn.Module, device: torch.device, config_text: str = "") -> str:
    """The disk-cache key of ``model``'s compiled forward on ``device`` (hex, 32 characters):
    everything the traced graph and its kernels depend on, i.e. the model's structure, every
    parameter's and buffer's name, shape and dtype (the same on the meta-device model before its
    weights load), ``config_text`` (the model's config as text: constants such as RoPE bases and
    norm epsilons; leave out what names the files, not the model), this rank's TP place, the
    torch thread count and the CPU's vector ISA (Inductor's C++ kernels specialize on both), the
    GPU model, torch's version and shardserve's layer and kernel sources."""
    group = get_tp_group()
    digest = hashlib.sha256()
    for part in (torch.__version__, type(model).__qualname__, repr(model), config_text, _source_digest(),
                 f"tp {group.tp_rank}/{group.tp_size} threads {torch.get_num_threads()} {device.type}",
                 torch.backends.cpu.get_cpu_capability(),
                 os.environ.get("SHARDSERVE_COMPILE_ASSERTS", "")):
        digest.update(part.encode() + b"\0")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\0".encode())
    if device.type == "cuda":
        digest.update(f"{torch.cuda.get_device_name(device)} {torch.version.cuda}\0".encode())
    return digest.hexdigest()[:32]


def _compiled_path(key: str) -> Path:
    return cache_dir() / f"forward-{key}.bin"


def _load_compiled(key: str, forward: Callable):
    """The compiled forward saved under ``key``, or None when there is none or it does not load."""
    _point_inductor_at_cache()
    path = _compiled_path(key)
    if not path.exists():
        return None
    try:
        with open(path, "rb") as file:
            compiled = torch.compiler.load_compiled_function(file, f_globals=forward.__globals__)
    except Exception as exc:   # another torch or GPU, a truncated file: compile again, replace it
        logger.warning("compiled forward %s does not load (%s: %s): compiling again", path, type(exc).__name__, exc)
        return None
    mark_used(path)   # kept by the pruning in _save
    return compiled


def start_loading(model: nn.Module, key: str) -> Future:
    """Read the compiled forward of ``key`` from the disk cache on a thread of its own, now: a rank
    calls this on its meta-device model, so that the read (most of it importing Inductor's runtime
    and probing the CPU's vector ISAs in subprocesses, ~0.8 s of CPU) overlaps the weights'
    loading. The future's result is the loaded function or None; :class:`CompiledForward` takes it."""
    future: Future = Future()
    forward = type(model).forward

    def load() -> None:
        try:
            future.set_result(_load_compiled(key, forward))
        except BaseException as exc:   # noqa: BLE001 - handed to the waiting thread
            future.set_exception(exc)

    threading.Thread(target=load, name="compiled-forward-load", daemon=True).start()
    return future


class CompiledForward:
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]`` of ``model`` through torch.compile.

    Args:
        model: the model (its opaque modules are registered here, before any trace); its class's
            ``forward(self, input_ids, positions)`` is what is compiled, with the model an argument
            (its parameters are graph inputs, not constants).
        key: the disk-cache key (:func:`forward_key`), or None to keep nothing on disk.
        loading: :func:`start_loading`'s future for ``key``, if the read started earlier.

    The first call compiles with Dynamo's ahead-of-time API (``torch.compile(...).aot_compile``:
    ``T`` unbacked, no specialization on 0 or 1, so the same graph serves every step) and saves the
    whole compiled function, Dynamo's transformed bytecode and Inductor's kernels, as
    ``$SHARDSERVE_CACHE/inductor/forward-<key>.bin``; a later start-up with the same key loads that
    file instead of tracing (vLLM's AOT compile; Dynamo's trace was ~4 s of the 8.9-s warm start of
    SmolLM2-135M). A file that does not load (another torch, a corrupt file) is compiled anew and
    replaced. The compiled function is called without Dynamo's guards (vLLM's custom dispatcher):
    the graph depends only on the parameters' shapes (in the key) and on ``T``, which is symbolic;
    a compiled function of its own per instance also keeps two models of one class apart.
    """

    def __init__(self, model: nn.Module, key: str | None = None, loading: Future | None = None) -> None:
        self.model = model
        self.modules = opaque_modules(model)
        self.key = key
        self.loading = loading
        _point_inductor_at_cache()
        self._compiled: Callable | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        global _ACTIVE_MODULES
        outer, _ACTIVE_MODULES = _ACTIVE_MODULES, self.modules
        try:
            if self._compiled is None:
                self._first(input_ids, positions)
            return self._compiled(self.model, input_ids, positions)
        finally:
            _ACTIVE_MODULES = outer

    @torch.inference_mode()
    def warm_up(self, block_size: int, device: torch.device) -> None:
        """Trace and compile (or load) now (start-up), on a 2-token step of one sequence in cache
        block 0 (and recurrent-state slot 0): both hold nothing yet, and a request zeroes a state
        slot when it gets it. Every TP rank calls this at the same time (the step holds the
        all-reduces)."""
        from shardserve.workers.activation import StepShape
        from shardserve.workers.forward_context import forward_context
        from shardserve.workers.memory_profile import step_batch
        from shardserve.workers.state_cache import SeqGroup, StateMetadata
        from shardserve.workers.step_inputs import DeviceStager, device_batch

        input_ids, meta, _ = device_batch(step_batch(StepShape(2, 1, 2, 2, 1), block_size), DeviceStager(device))
        if getattr(self.model, "state_layers", list)():
            cu_seqlens = torch.tensor([0, 2], dtype=torch.int32, device=device)
            slots = torch.zeros(1, dtype=torch.int32, device=device)
            meta.state = StateMetadata(cu_seqlens, slots, SeqGroup(None, cu_seqlens, slots), None, keep=False)
        with forward_context(meta):
            self(input_ids, meta.positions)

    def _first(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        global _LOADS
        start = time.perf_counter()
        compiled = self._load()
        if compiled is not None:
            _LOADS += 1
            how = "loaded from the compile cache"
        else:
            before = compile_stats()
            compiled = self._compile(input_ids, positions)
            after = compile_stats()
            cached = after["cache_hits"] > before["cache_hits"] and after["cache_misses"] == before["cache_misses"]
            how = "traced; kernels loaded from the compile cache" if cached else "traced; kernels generated and built"
            self._save(compiled)
        compiled.disable_guard_check()
        self._compiled = compiled
        logger.info("compiled forward: %.1f s (%s)", time.perf_counter() - start, how)

    def _compile(self, input_ids: torch.Tensor, positions: torch.Tensor):
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        # Inductor's size/stride asserts (~580 a SmolLM2 step, 0.4 ms of 6) check that extern
        # kernels and opaque ops return what their fakes promised; the tests turn them on
        # (SHARDSERVE_COMPILE_ASSERTS=1, tests/conftest.py), a served forward runs without them.
        compiler = torch.compile(type(self.model).forward, fullgraph=True, dynamic=False,
                                 options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                                          "size_asserts": os.environ.get("SHARDSERVE_COMPILE_ASSERTS") == "1"})
        # T is symbolic even when the first step has one token: no 0/1 specialization
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return compiler.aot_compile(((self.model, input_ids, positions), {}))

    def _load(self):
        if self.loading is not None:
            return self.loading.result()
        return _load_compiled(self.key, type(self.model).forward) if self.key else None

    def _save(self, compiled) -> None:
        """Write the compiled forward (mode 0644) through a private staging folder, renamed into
        place (the staging folder removed whatever happens); keep the newest
        ``COMPILED_FORWARDS_KEPT``. A cache that cannot be written keeps it in memory only."""
        if self.key is None:
            return
        path = _compiled_path(self.key)
        staging = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=path.parent))
            compiled.save_compiled_function(str(staging / path.name))
            (staging / path.name).chmod(0o644)
            os.replace(staging / path.name, path)
            keep_newest(path.parent, "forward-*.bin", COMPILED_FORWARDS_KEPT)
        except Exception as exc:   # a read-only cache, a backend that does not serialize: keep it in memory
            logger.warning("compiled forward not saved to %s (%s: %s): the next start-up compiles again",
                           path, type(exc).__name__, exc)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
