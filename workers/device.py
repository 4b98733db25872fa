"""Where a rank computes and in what dtype, and how much of the device its caches may take.

One rule for every command and every rank (``--device``, ``--dtype``, ``--gpu-memory-utilization``):

- device ``auto``: ``cuda`` when this process (a Ray actor: the GPUs Ray gave it) sees a GPU, else
  ``cpu``; ``cuda`` without a visible GPU is an error, not a silent fallback.
- dtype ``auto``: bfloat16 on CUDA; on CPU bfloat16 with packed weights for a GGUF file of mostly
  Q4_0 / Q4_1 / Q8_0 matrices (or ``--quantization``), float32 otherwise.
- KV cache on CUDA (vLLM's rule): ``utilization * total`` bytes of the GPU, minus the weights, minus
  the peak activation memory of one profiling forward, minus memory held outside torch's allocator
  (CUDA context, NCCL buffers, other processes). On CPU the cache takes ``--kv-cache-gib``. Every
  rank of a group then allocates the smallest block count any rank can hold.

Errors are :class:`DeviceConfigError` (a request the machine cannot satisfy) and
:class:`DoesNotFitError` (the model or its cache does not fit); both are ``ValueError`` so the CLI
turns them into one line on stderr and exit code 2. Their messages name the numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# NOTE: torch is imported inside the functions: the CLI validates flags with this module before
# anything heavy is imported.
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
GIB = 2**30


class DeviceConfigError(ValueError):
    """A device request this machine cannot satisfy (``--device cuda`` without a GPU)."""


class DoesNotFitError(ValueError):
    """The model, its activations or its cache do not fit the device; the message names the sizes."""


def visible_gpus() -> int:
    """CUDA GPUs this process can use (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str, num_gpus: int | None = None) -> str:
    """The device a rank computes on.

    Args:
        requested: ``auto``, ``cuda`` or ``cpu`` (``--device``).
        num_gpus: GPUs available to this rank (default: :func:`visible_gpus`).

    Returns:
        ``"cuda"`` or ``"cpu"``.

    Raises:
        DeviceConfigError: ``cuda`` requested but no GPU is available, or an unknown name.
    """
    if requested not in DEVICES:
        raise DeviceConfigError(f"--device must be one of {', '.join(DEVICES)}; got {requested!r}")
    gpus = visible_gpus() if num_gpus is None else num_gpus
    if requested == "cuda" and gpus < 1:
        import torch

        raise DeviceConfigError(
            f"--device cuda: no CUDA GPU is visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "use --device cpu or auto")
    if requested == "auto":
        return "cuda" if gpus > 0 else "cpu"
    return requested


def resolve_dtype(requested: str, device: str, gguf_types: dict[str, int] | None = None,
                  quantization: str = "none"):
    """The compute and weight dtype (a ``torch.dtype``).

    ``auto`` is bfloat16 on CUDA. On CPU it is bfloat16 when the weights will be packed for the CPU
    kernels (``workers/quantization.py``, which need bfloat16 activations for their fast path):
    a GGUF file most of whose matrix elements are Q4_0 / Q4_1 / Q8_0, or ``--quantization``;
    float32 otherwise (and ``float32`` is the exact, dequantized path).

    Args:
        requested: ``--dtype``. device: ``"cuda"``/``"cpu"``.
        gguf_types: for a GGUF file, elements of its 2-D weights per GGUF type name; else None.
        quantization: ``--quantization``.

    Raises:
        ValueError: an unknown name.
    """
    import torch

    if requested not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {requested!r}")
    if requested != "auto":
        return getattr(torch, requested)
    if device.startswith("cuda") or quantization != "none":
        return torch.bfloat16
    if gguf_types:
        from shardserve.workers.quantization import PACKED_GGUF_TYPES

        packed = sum(count for name, count in gguf_types.items() if name in PACKED_GGUF_TYPES)
        if 2 * packed > sum(gguf_types.values()):
            return torch.bfloat16
    return torch.float32


def check_utilization(utilization: float) -> None:
    """Raises ValueError unless ``0 < utilization <= 1`` (``--gpu-memory-utilization``)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")


def gib(num_bytes: float) -> str:
    """``num_bytes`` as ``"12.34 GiB"`` (for messages and logs)."""
    return f"{num_bytes / GIB:.2f} GiB"


def host_memory_available() -> int:
    """Bytes this process can still allocate on the host: ``MemAvailable`` of ``/proc/meminfo``,
    capped by a cgroup v2 memory limit when one is set (containers); 0 when unknown."""
    available = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        return 0
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read().strip())
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


@dataclass(slots=True)
class MemoryPlan:
    """What one rank's memory holds (bytes); logged at start-up and returned to the coordinator.

    On CPU ``capacity`` is the host memory available at start-up and ``activation`` / ``other``
    are 0 (not profiled); on CUDA ``capacity`` is ``utilization * total``.
    """

    device: str             # "cuda:0" / "cpu"
    capacity: int           # bytes this rank may use in all
    weights: int            # model parameters and buffers on this rank
    activation: int = 0     # peak extra memory of one profiling forward at max_num_batched_tokens
    other: int = 0          # held outside torch's allocator (CUDA context, NCCL, other processes)
    cache: int = 0          # the KV / indexer / draft caches may take this much

    def summary(self) -> str:
        return (f"{self.device}: weights {gib(self.weights)}, activations {gib(self.activation)}, "
                f"other {gib(self.other)}, KV cache budget {gib(self.cache)} of {gib(self.capacity)}")


def check_weights_fit(weight_bytes: int, capacity: int, where: str, hint: str) -> None:
    """Fail before loading when this rank's weights alone exceed what it may use.

    Args:
        weight_bytes: parameter bytes this rank will hold (from a meta-device build).
        capacity: bytes available to the rank (0 = unknown: no check).
        where: the device and the rule that set ``capacity``, for the message.
        hint: what the user can change.

    Raises:
        DoesNotFitError: ``weight_bytes > capacity``.
    """
    if capacity and weight_bytes > capacity:
        raise DoesNotFitError(f"the model does not fit: its weights need {gib(weight_bytes)} on this rank, "
                              f"{where} leaves {gib(capacity)}; {hint}")


def cuda_cache_budget(total: int, utilization: float, weights: int, activation: int, other: int,
                      min_bytes: int, device: str) -> MemoryPlan:
    """The KV cache budget of one CUDA rank (vLLM's ``--gpu-memory-utilization`` rule).

    ``cache = utilization * total - weights - activation - other``.

    Args:
        total: the GPU's memory (``torch.cuda.mem_get_info()[1]``), bytes.
        utilization: fraction of ``total`` this rank may use, ``(0, 1]``.
        weights: bytes of the loaded weights.
        activation: peak bytes of the profiling forward above the weights.
        other: bytes held outside torch's allocator (``total - free - reserved``).
        min_bytes: the smallest useful cache (one block of every layer), bytes.
        device: name for messages (``"cuda:0"``).

    Returns:
        the :class:`MemoryPlan` with ``cache`` set.

    Raises:
        DoesNotFitError: less than ``min_bytes`` is left for the cache.
    """
    capacity = int(utilization * total)
    plan = MemoryPlan(device, capacity, weights, activation, other)
    plan.cache = capacity - weights - activation - other
    if plan.cache < min_bytes:
        raise DoesNotFitError(
            f"the model does not fit on {device}: --gpu-memory-utilization {utilization} x {gib(total)} = "
            f"{gib(capacity)}, minus weights {gib(weights)}, activations {gib(activation)} and other "
            f"{gib(other)} leaves {gib(plan.cache)} for the KV cache, less than one block ({min_bytes} bytes); "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use more tensor-parallel ranks")
    return plan


def cpu_cache_plan(cache_bytes: int, weights: int, device: str = "cpu") -> MemoryPlan:
    """The CPU rank's plan: ``--kv-cache-gib`` (or the exact block count) against the host memory
    available at start-up.

    Raises:
        DoesNotFitError: weights plus cache exceed the available host memory.
    """
    available = host_memory_available()
    plan = MemoryPlan(device, available, weights, cache=cache_bytes)
    if available and weights + cache_bytes > available:
        raise DoesNotFitError(
            f"the model does not fit in host memory: weights {gib(weights)} + KV cache {gib(cache_bytes)} "
            f"exceed the {gib(available)} available; lower --kv-cache-gib or use more tensor-parallel ranks")
    return plan


CPU_KERNEL_CACHE_ENTRIES = 32


def bound_cpu_kernel_caches(entries: int = CPU_KERNEL_CACHE_ENTRIES) -> None:
    """Cap the shape-keyed caches of torch's oneDNN CPU kernels at ``entries`` (unless the user set
    them): oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's computation
    cache (``LRU_CACHE_CAPACITY``) keep up to 1024 entries each by default, and the bf16 attention
    matmuls take a new shape every decode step (the context grows), so a CPU rank grew by about
    1 MiB per step at 16 sequences (SmolLM2) until both were full. One step's layers share their
    shapes, so a few dozen entries keep every hit that matters. Both are read when the first
    oneDNN kernel runs: call this before that (``ModelRunner`` does, for CPU ranks)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))
