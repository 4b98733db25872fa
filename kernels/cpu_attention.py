"""Small-batch decode attention, with this step's K/V store, on CPU in C (``kernels/cpu_attention.c``).

A batch-1 decode layer of SmolLM2 spent ~35 us of host time in the torch ops of
:func:`kernels.paged_attention.store_kv_ref` and :func:`kernels.paged_attention.paged_decode_attention`
(two row scatters, two block gathers, the flash-attention call and their dispatch) for ~1 us of
arithmetic; the C kernel does the same work in one call, on the calling thread. Same contracts
and the same float32 math (scores, softmax and weighted sum in float32, one rounding to bf16), so
the torch paths are its references (``tests/kernels/test_cpu_attention.py``).

The source is compiled once per host by its C compiler (``$CC``, else ``cc``; ``-O3
-march=native``) into ``$SHARDSERVE_CACHE/cpu_kernels``, keyed by the source, the flags, the
compiler's version and the CPU's feature flags, and loaded with ctypes (a damaged file is built
again). Where no compiler works :func:`available` is False, callers keep the torch paths and the
failure is logged once; ``SHARDSERVE_KERNELS`` set (``torch``) keeps them too, silently.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast"]
MAX_GROUP, MAX_HEAD_DIM = 8, 256   # the C kernel's stack buffers: query heads per KV head, head_dim
MAX_DECODE_KEYS = 4096             # batch x longest context up to which the one-thread kernel was measured no
                                   # slower than torch's two threads (SmolLM2's heads, 2-vCPU VM: 328 vs 353 us
                                   # at 32 x 128 keys, 54 vs 108 us at 1 x 600; README "Decode attention on CPU")

_lib: ctypes.CDLL | None = None
_failed = False
_lock = threading.Lock()
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _cache_dir() -> Path:
    return Path(os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve") / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _target() -> tuple[str, Path]:
    """The compiler and the library file it builds here: named by the source, the flags, the
    compiler's version and the CPU's feature flags.

    Raises:
        OSError, subprocess.CalledProcessError: the compiler does not run.
    """
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join([compiler, *FLAGS]).encode(), version,
                                     _cpu_flags().encode()]))
    return compiler, _cache_dir() / f"cpu_attention-{key.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    """Compile (or find) and load the shared library.

    Raises:
        OSError, subprocess.CalledProcessError: no working C compiler, or loading failed.
    """
    compiler, target = _target()
    try:
        lib = ctypes.CDLL(str(target)) if target.exists() else None
    except OSError:   # a damaged file (a full disk, a copied cache): built again below
        lib = None
    if lib is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(built, target)   # atomic: another process may build the same file at once
        lib = ctypes.CDLL(str(target))
    lib.decode_attention.argtypes = [_P, _I, _P, _P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _P, _I, _P, _I,
                                     _P]
    lib.decode_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the C kernels are loaded (built on first call); False where they cannot be or
    ``SHARDSERVE_KERNELS`` asks for another implementation."""
    global _lib, _failed
    if os.environ.get("SHARDSERVE_KERNELS"):
        return False
    if _lib is not None:
        return True
    if _failed:
        return False
    with _lock:
        if _lib is None and not _failed:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as exc:
                _failed = True
                detail = getattr(exc, "stderr", b"") or b""
                logger.warning("CPU attention kernels unavailable (%s%s); decode attention stays on torch ops",
                               exc, f": {detail.decode(errors='replace')[:200]}" if detail else "")
    return _lib is not None


def _rows_ok(rows: torch.Tensor) -> bool:
    """``[n, heads, D]`` bf16 rows with each token's heads contiguous (any token stride)."""
    return (rows.dtype == torch.bfloat16 and rows.device.type == "cpu" and rows.stride(2) == 1
            and rows.stride(1) == rows.shape[2])


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_seq_len: int, key: torch.Tensor | None = None,
                     value: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                     step_cache: dict | None = None) -> torch.Tensor | None:
    """:func:`kernels.paged_attention.paged_decode_attention` in C where it applies, else None;
    with ``key``, ``value`` and ``slot_mapping``, this step's K/V are stored first
    (:func:`kernels.paged_attention.store_kv_ref`), in the same call.

    Args:
        query: ``[B, H, D]`` bf16 (heads contiguous per token); query head ``h`` reads KV head
            ``h // (H / Hkv)``.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` bf16, contiguous.
        block_tables: ``[B, max_blocks]`` int32. seq_lens: ``[B]`` int64, keys per sequence.
        scale: softmax scale. max_seq_len: the longest context (host int).
        key, value: ``[B, Hkv, D]`` bf16 (heads contiguous per token). slot_mapping: ``[B]`` int64
            (negative: not stored).
        step_cache: the step's cache (``AttentionMetadata.step_cache``): what depends only on the
            step (the checks of its tables, their addresses, the score scratch) is worked out by the
            first layer and reused by the others (~5 us of host time a layer saved).

    Returns:
        ``[B, H, D]`` bf16, or None (nothing stored) where the torch path must run: other dtypes or
        layouts, ``H`` not a multiple of ``Hkv`` or ``H / Hkv > 8``, ``D > 256``, more than
        :data:`MAX_DECODE_KEYS` keys in all, no compiler. A sequence of no keys attends to nothing (zeros).

    Raises:
        IndexError: a slot, block id or sequence length outside the cache or the block table
            (nothing written; the torch path raises there too).
    """
    batch, num_heads, head_dim = query.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    cache_key = ("cpu_decode_attention", group, slot_mapping is not None)
    step = step_cache.get(cache_key) if step_cache is not None else None
    if step is None:
        step = _step_args(block_tables, seq_lens, slot_mapping, max_seq_len, group)
        if step_cache is not None:
            step_cache[cache_key] = step
    if not step or not (step[0] == batch and num_heads == group * num_kv and group <= MAX_GROUP
                        and head_dim <= MAX_HEAD_DIM and _rows_ok(query) and k_cache.dtype == torch.bfloat16
                        and v_cache.dtype == torch.bfloat16 and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    _, tables, width, lens, slots, scratch = step
    stored = (0, 0, 0, 0, 0)
    if slot_mapping is not None:
        if not (_rows_ok(key) and _rows_ok(value) and key.shape[0] == batch and key.shape[1:] == (num_kv, head_dim)
                and value.shape == key.shape):
            return None
        stored = (key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots)
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.bfloat16)
    if _lib.decode_attention(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                             tables, width, lens, max_seq_len, out.data_ptr(), batch, num_heads, num_kv, head_dim,
                             k_cache.shape[1], scale, scratch.data_ptr(), *stored):
        raise IndexError("decode attention: a slot, block id or sequence length is outside the cache or the block "
                         f"table (max_seq_len {max_seq_len}, {k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    return out


def _step_args(block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor | None,
               max_seq_len: int, group: int) -> tuple | bool:
    """What :func:`decode_attention` needs of the step, the same for every layer: ``(batch, block
    tables' address, their width, seq_lens' address, slot_mapping's address, score scratch)``, or
    False where the C kernel does not apply to this step."""
    batch = seq_lens.shape[0]
    if not (batch * max_seq_len <= MAX_DECODE_KEYS and block_tables.dtype == torch.int32
            and block_tables.is_contiguous() and block_tables.shape[0] == batch and seq_lens.dtype == torch.int64
            and seq_lens.is_contiguous() and not block_tables.is_cuda and available()):
        return False
    if slot_mapping is not None and not (slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        return False
    scratch = torch.empty(max(group, 1) * max_seq_len, dtype=torch.float32)
    return (batch, block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
            slot_mapping.data_ptr() if slot_mapping is not None else 0, scratch)
