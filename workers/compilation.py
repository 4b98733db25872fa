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
once it is traced (vLLM's custom dispatcher), since nothing in the graph depends on more than
the parameters' shapes and ``T``.

Disk cache: Inductor's FX-graph and AOTAutograd caches live under
``$SHARDSERVE_CACHE/inductor`` (``TORCHINDUCTOR_CACHE_DIR``), keyed by the graph (hence the model
shape, dtype, TP split and torch version), so a second start-up of the same model only traces
(Dynamo) and loads the compiled kernels; :func:`compile_stats` tells which happened.

``--compile auto`` compiles where it was measured to pay (``benchmarks/bench_compile.py``): CPU
ranks. On the 2-core development machine (SmolLM2-135M Q4_1, one thread, one run) the compiled
forward cut decode CPU per step by 22% at batch 1 and 18% at batch 8, for +24 s of start-up CPU
with a warm cache (Dynamo traces again; Inductor loads the kernels) and ~95 s cold: it pays back
after ~1.4k decode steps. CUDA ranks are not compiled under ``auto`` (not measured yet; their
decode graphs already remove the launch cost). With ``on`` the decode graphs
(``workers/cuda_graphs.py``) capture the compiled forward, and prefill / verify steps run it
outside a graph.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from shardserve.kernels.ops import define_op
from shardserve.workers.distributed import get_tp_group

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


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SHARDSERVE_CACHE/inductor`` (default
    ``~/.cache/shardserve/inductor``)."""
    base = Path(os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve")
    return base / "inductor"


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
    ``cache_misses`` (Inductor FX-graph cache: a miss generated and built kernels)."""
    from torch._dynamo.utils import counters

    return {"traces": int(counters["stats"]["unique_graphs"]),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}


def own_code(method: Callable) -> Callable:
    """``method`` (a bound method) over a copy of its function's code object.

    Dynamo keeps compiled graphs on the code object, so every instance of a model class shares
    them; without guards (:class:`CompiledForward`), a second model of the same class but other
    shapes in the same process (a swapped-in model, a second engine) would run the first one's
    graph and fail on, or silently misread, its parameters. A code object of its own gives each
    compiled forward its own cache entry.
    """
    func = method.__func__
    clone = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                               func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(clone, method.__self__)


class CompiledForward:
    """``forward(input_ids [T], positions [T]) -> hidden [T, H]`` of ``model`` through torch.compile.

    Args:
        model: the model (its opaque modules are registered here, before any trace).
        forward: the model's forward (called inside a forward context).

    The first call traces and compiles (``T`` unbacked: no specialization on 0 or 1, so the same
    graph serves every step); later calls run the compiled code.
    """

    def __init__(self, model: nn.Module, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.modules = opaque_modules(model)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
        # No guards kept (vLLM's dispatcher): the graph depends only on the parameters' shapes and on
        # T, which is symbolic, so re-checking ~1k guards every step would only cost time.
        # Inductor's size/stride asserts (~580 a SmolLM2 step, 0.4 ms of 6) check that extern
        # kernels and opaque ops return what their fakes promised; the tests turn them on
        # (SHARDSERVE_COMPILE_ASSERTS=1, tests/conftest.py), a served forward runs without them.
        self._compiled = torch.compile(own_code(forward), fullgraph=True, dynamic=False,
                                       options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                                                "size_asserts": os.environ.get("SHARDSERVE_COMPILE_ASSERTS") == "1"})
        self.compiled = False
        self.compile_s = 0.0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        global _ACTIVE_MODULES
        outer, _ACTIVE_MODULES = _ACTIVE_MODULES, self.modules
        try:
            if self.compiled:
                return self._compiled(input_ids, positions)
            return self._first(input_ids, positions)
        finally:
            _ACTIVE_MODULES = outer

    @torch.inference_mode()
    def warm_up(self, model: nn.Module, block_size: int, device: torch.device) -> None:
        """Trace and compile now (start-up), on a 2-token step of one sequence in cache block 0 (and
        recurrent-state slot 0): both hold nothing yet, and a request zeroes a state slot when it
        gets it. Every TP rank calls this at the same time (the graph holds the all-reduces)."""
        from shardserve.workers.activation import StepShape
        from shardserve.workers.forward_context import forward_context
        from shardserve.workers.memory_profile import step_batch
        from shardserve.workers.state_cache import SeqGroup, StateMetadata
        from shardserve.workers.step_inputs import DeviceStager, device_batch

        input_ids, meta, _ = device_batch(step_batch(StepShape(2, 1, 2, 2, 1), block_size), DeviceStager(device))
        if getattr(model, "state_layers", list)():
            cu_seqlens = torch.tensor([0, 2], dtype=torch.int32, device=device)
            slots = torch.zeros(1, dtype=torch.int32, device=device)
            meta.state = StateMetadata(cu_seqlens, slots, SeqGroup(None, cu_seqlens, slots), None, keep=False)
        with forward_context(meta):
            self(input_ids, meta.positions)

    def _first(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        before, start = compile_stats(), time.perf_counter()
        # T is symbolic even when the first step has one token: no 0/1 specialization
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            out = self._compiled(input_ids, positions)
        self.compile_s = time.perf_counter() - start
        self.compiled = True
        after = compile_stats()
        cached = after["cache_hits"] > before["cache_hits"] and after["cache_misses"] == before["cache_misses"]
        logger.info("compiled forward: %.1f s (%s)", self.compile_s,
                    "kernels loaded from the compile cache" if cached else "kernels generated and built")
        return out
