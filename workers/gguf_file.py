"""A GGUF file's metadata, read once per process.

Start-up used to parse a GGUF file's metadata three times in every process that loads a model:
transformers' ``AutoConfig`` and ``AutoTokenizer`` (``gguf_file=``) each ran ``gguf.GGUFReader``
through ``load_gguf_checkpoint``, and :class:`workers.checkpoint.GGUFCheckpoint` ran it a third time.
``GGUFReader`` builds a numpy view of every metadata element, the 49,152-token vocabulary and its
merges included: about 5 s per parse for SmolLM2-135M on one core. Two things here cut that to one:

- :func:`read_header`: the scalars of the metadata and the tensor table (name, type, shape, where
  its bytes lie), walked with ``struct`` (string arrays are skipped, not decoded): tens of
  milliseconds. :class:`workers.checkpoint.GGUFCheckpoint` needs nothing else.
- :func:`transformers_parses_once`: while it is active, transformers' metadata-only
  ``load_gguf_checkpoint(path, return_tensors=False)`` (its GGUF -> config conversion) runs once per
  file and process; later calls get a copy of the first answer. The config and the tokenizer are
  still made by transformers' own code (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file=``), so
  they equal what the oracle tests load; only the repeated read is gone. The tokenizer's own
  vocabulary read (transformers' fast reader, two string arrays) is not a full parse and stays.

Both are keyed by the file's identity (real path, size, modification time in ns): a file replaced on
disk (a weight reload) is read again. The conversion is also kept on disk (``$SHARDSERVE_CACHE/gguf-metadata``,
JSON, keyed by the header's bytes): a later process, a restarted server's ranks and coordinator, reads
it back instead of parsing.

Format source: ggml's ``docs/gguf.md`` (GGUF v2/v3, little-endian); element sizes and quantized
block sizes come from the ``gguf`` package (``GGML_QUANT_SIZES``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shardserve.workers.model_source import cache_dir, keep_newest, mark_used

# metadata value type -> struct format of one element (GGUF 8 = string, 9 = array are variable-length)
_SCALAR_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    """The file is not a GGUF v2/v3 file, or its header ends early."""


@dataclass(frozen=True, slots=True)
class GGUFTensorEntry:
    """One row of a GGUF file's tensor table.

    Attributes:
        name: GGUF tensor name (``blk.0.attn_q.weight``).
        dims: GGUF dims, fastest-moving first (the reverse of the torch shape).
        ggml_type: ``gguf.GGMLQuantizationType`` value of its storage.
        offset: byte offset of its data from the start of the file.
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What :func:`read_header` read.

    Attributes:
        metadata: metadata key -> value; numbers, strings and arrays of numbers as Python values,
            arrays of strings (the vocabulary, merges) as None: they are skipped, not decoded.
        tensors: the tensor table, in file order.
        file_size: bytes of the file (tensors past it mean the file was cut short).
        digest: sha256 (hex) of the header's bytes, metadata and tensor table: what the file's
            metadata conversion depends on, whatever its path or modification time.
    """

    metadata: dict
    tensors: tuple[GGUFTensorEntry, ...]
    file_size: int
    digest: str


def file_identity(path: str | os.PathLike) -> tuple[str, int, int]:
    """``(real path, size in bytes, mtime in ns)``: the cache key of a file's parse.

    Raises:
        OSError: the file cannot be stat'ed.
    """
    real = os.path.realpath(path)
    stat = os.stat(real)
    return real, stat.st_size, stat.st_mtime_ns


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The metadata scalars and tensor table of a GGUF file, cached per file identity.

    Raises:
        OSError: the file cannot be opened.
        GGUFHeaderError: not GGUF v2/v3, or the header is cut short.
    """
    return _read_header(*file_identity(path))


@functools.lru_cache(maxsize=8)
def _read_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as file:
        if size < 24:
            raise GGUFHeaderError(f"{size} bytes: too short for a GGUF header")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                return _walk(blob, size)
            except struct.error as exc:   # a read past the end of the file
                raise GGUFHeaderError(f"the header ends early ({exc})") from None


def _walk(blob, size: int) -> GGUFHeader:
    if blob[:4] != b"GGUF":
        raise GGUFHeaderError("no GGUF magic bytes at the start")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} (this reader reads v2 and v3)")
    pos, metadata = 24, {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, value_type)
    tensors = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (num_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        tensors.append((name, dims, ggml_type, offset))
    alignment = metadata.get("general.alignment") or _DEFAULT_ALIGNMENT
    data_start = -(-pos // alignment) * alignment
    entries = tuple(GGUFTensorEntry(name, tuple(dims), ggml_type, data_start + offset)
                    for name, dims, ggml_type, offset in tensors)
    with memoryview(blob) as whole, whole[:pos] as header:   # released before the map closes
        digest = hashlib.sha256(header).hexdigest()
    return GGUFHeader(metadata, entries, size, digest)


def _string(blob, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    if end > len(blob):
        raise struct.error(f"a string of {length} bytes at {pos} runs past the end")
    return blob[pos + 8:end].decode("utf-8", errors="replace"), end


def _value(blob, pos: int, value_type: int):
    if value_type in _SCALAR_FORMAT:
        fmt = _SCALAR_FORMAT[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _string(blob, pos)
    if value_type != _ARRAY:
        raise GGUFHeaderError(f"metadata value type {value_type} at byte {pos} is not a GGUF type")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _SCALAR_FORMAT:
        fmt = _SCALAR_FORMAT[element_type]
        width = struct.calcsize(fmt)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width
    if element_type != _STRING:
        raise GGUFHeaderError(f"metadata array of type {element_type} at byte {pos} (only numbers and strings)")
    for _ in range(count):   # skipped: variable-length, so walked
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return None, pos


# -- transformers' metadata conversion, once per file ---------------------------------------------
_patch_lock = threading.Lock()
_patch_depth = 0
_original_loader = None


METADATA_CACHE_ENTRIES = 16   # converted files kept on disk (the least recently used beyond are removed)
_PARTS = ("config", "tokenizer", "tokenizer_config")   # what transformers' conversion returns, read back


@functools.lru_cache(maxsize=4)
def _converted(path: str, size: int, mtime_ns: int) -> dict:
    """transformers' ``load_gguf_checkpoint(path, return_tensors=False)``: its config, tokenizer and
    tokenizer-config dicts converted from the file's metadata (the one full parse), kept as JSON in
    ``$SHARDSERVE_CACHE/gguf-metadata`` under the digest of the file's header bytes and the
    transformers and gguf versions, so that a later process reads it back (~10 ms for
    SmolLM2-135M's 49,152-token vocabulary instead of ~2.3 s of parsing). An entry that does not
    read back as such a conversion is parsed again and replaced."""
    from importlib.metadata import version

    try:
        digest = _read_header(path, size, mtime_ns).digest
    except (OSError, GGUFHeaderError):   # transformers' parser says what is wrong with the file
        return _original_loader(path, return_tensors=False)
    name = hashlib.sha256(f"{digest}\0{version('transformers')}\0{version('gguf')}".encode()).hexdigest()[:32]
    stored = cache_dir() / "gguf-metadata" / f"{name}.json"
    try:
        converted = json.loads(stored.read_text())
    except (OSError, ValueError):
        converted = None
    if isinstance(converted, dict) and all(isinstance(converted.get(part), dict) for part in _PARTS):
        mark_used(stored)   # kept by the pruning in _store
        return converted
    converted = _original_loader(path, return_tensors=False)
    _store(stored, converted)
    return converted


def _store(stored: Path, converted: dict) -> None:
    """Write ``converted`` to ``stored`` (mode 0644) when JSON gives back exactly the same (never a
    changed type), through a temporary file renamed into place (removed if that fails); keep the
    newest ``METADATA_CACHE_ENTRIES``. A cache that cannot be written is skipped (the next process
    parses again)."""
    try:
        text = json.dumps(converted)
        if json.loads(text) != converted:
            return
        stored.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=stored.parent, suffix=".tmp", delete=False) as file:
            temporary = Path(file.name)
            file.write(text)
    except (OSError, TypeError, ValueError):
        return
    try:
        temporary.chmod(0o644)
        os.replace(temporary, stored)
        keep_newest(stored.parent, "*.json", METADATA_CACHE_ENTRIES)
    except OSError:
        temporary.unlink(missing_ok=True)


def _load_gguf_checkpoint_once(gguf_checkpoint_path, return_tensors=False, model_to_load=None, torch_dtype=None):
    if return_tensors or model_to_load is not None:
        return _original_loader(gguf_checkpoint_path, return_tensors, model_to_load, torch_dtype)
    return copy.deepcopy(_converted(*file_identity(gguf_checkpoint_path)))


@contextmanager
def transformers_parses_once():
    """Within this block, transformers' metadata-only ``load_gguf_checkpoint`` answers from a
    per-file cache (see the module docstring). Calls that read tensors pass through unchanged.

    Reentrant and thread-safe; the cache outlives the block, so a later block in the same process
    (the tokenizer after the config, a reload's config check) reads nothing again.
    """
    global _patch_depth, _original_loader
    from transformers import modeling_gguf_pytorch_utils as module

    with _patch_lock:
        if _patch_depth == 0:
            _original_loader = module.load_gguf_checkpoint
            module.load_gguf_checkpoint = _load_gguf_checkpoint_once
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                module.load_gguf_checkpoint = _original_loader
