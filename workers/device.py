"""Where a rank computes and in what dtype, and how much of the device its caches may take.

One rule for every command and every rank (``--device``, ``--dtype``, ``--gpu-memory-utilization``):

- device ``auto``: ``cuda`` when this process (a Ray actor: the GPUs Ray gave it) sees a GPU, else
  ``cpu``; ``cuda`` without a visible GPU is an error, not a silent fallback.
- dtype ``auto``: bfloat16 on CUDA; on CPU bfloat16 with packed weights for a GGUF file of mostly
  Q4_0 / Q4_1 / Q8_0 matrices (or ``--quantization``), float32 otherwise.
- KV cache: ``workers/plan.py`` (on CUDA ``utilization * total`` bytes of the GPU less the weights,
  the activation and graph reserves and the memory held outside torch; on CPU ``--kv-cache-gib``).

Errors are :class:`DeviceConfigError` (a request the machine cannot satisfy) and
:class:`DoesNotFitError` (the model or its cache does not fit); both are ``ValueError`` so the CLI
turns them into one line on stderr and exit code 2. Their messages name the numbers.
"""

from __future__ import annotations

import os

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


def host_memory_available(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes this process can still allocate on the host: ``MemAvailable`` of ``/proc/meminfo``,
    capped by a cgroup v2 memory limit when one is set (containers); 0 when unknown.

    Under a limit, what is left is ``memory.max - memory.current`` plus the cgroup's page cache
    (``active_file + inactive_file`` of ``memory.stat``, which the kernel reclaims before it
    refuses an allocation; ``MemAvailable`` counts it alike). ``memory.current`` alone counts every
    file the container read or wrote: after installs and checkpoint reads it can sit near the limit,
    where a plan against ``max - current`` would find no room even for a tiny model.

    Args:
        proc, cgroup: where procfs and the cgroup v2 hierarchy are mounted (tests point them at files).
    """
    available = 0
    try:
        with open(f"{proc}/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return 0
    try:
        with open(f"{cgroup}/memory.max") as fh:
            limit = fh.read().strip()
        with open(f"{cgroup}/memory.current") as fh:
            used = int(fh.read().strip())
    except (OSError, ValueError):
        return available
    if limit == "max":
        return available
    cache = 0
    try:
        with open(f"{cgroup}/memory.stat") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key in ("active_file", "inactive_file"):
                    cache += int(value)
    except (OSError, ValueError):
        pass
    try:
        return min(available, max(0, int(limit) - used + cache))
    except ValueError:
        return available


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
