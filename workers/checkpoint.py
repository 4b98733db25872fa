"""Checkpoint readers: HF safetensors folders and GGUF files behind one interface.

Both readers expose tensors under their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``)
as :class:`LazyTensor` handles. A handle knows its shape without reading data; indexing it reads
only the requested slice (safetensors ``get_slice``) or dequantizes that one tensor and slices it
(GGUF), so a tensor-parallel rank never materializes the whole model.

Every failure is a :class:`CheckpointError` whose message names the file and, where there is
one, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from shardserve.workers.gguf_file import read_header
from shardserve.workers.gguf_names import GGUF_TO_HF, gguf_to_hf_name
from shardserve.workers.quantization import PACKED_GGUF_TYPES, decode_gguf


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, incomplete or of an unsupported format."""


@dataclass(slots=True)
class LazyTensor:
    """A tensor in a checkpoint, read on indexing.

    Attributes:
        name: HF tensor name.
        file: path of the file that holds it (for error messages).
        shape: logical torch shape (row-major, HF orientation: ``[out_features, in_features]``).
        _read: callable taking an index (tuple of slices) and returning a float32/bf16/fp8 tensor.
        quant_type: GGUF quantization type name (``"Q4_1"``, ``"Q6_K"``, ...); None for plain arrays.
        _quantized: for the types with an integer form (``workers/quantization.py``), a callable
            returning the whole tensor as a :class:`~workers.quantization.QuantizedWeight`.
    """

    name: str
    file: str
    shape: tuple[int, ...]
    _read: Callable[[tuple], torch.Tensor]
    quant_type: str | None = None
    _quantized: Callable[[], object] | None = None

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        return self._read(index)

    def load(self) -> torch.Tensor:
        """Read the whole tensor."""
        return self._read((slice(None),))

    def quantized(self):
        """The whole tensor in integer form (a ``QuantizedWeight``), without a float round trip.

        Raises:
            CheckpointError: the tensor has no integer form, or its blocks cannot be read.
        """
        if self._quantized is None:
            raise CheckpointError(f"{self.file}: tensor {self.name!r} ({self.quant_type}) has no integer form")
        return self._quantized()

    def check_shape(self, expected: tuple[int, ...]) -> None:
        """Raises:
            CheckpointError: the tensor's shape is not ``expected`` (naming file and tensor).
        """
        if tuple(self.shape) != tuple(expected):
            raise CheckpointError(
                f"{self.file}: tensor {self.name!r} has shape {list(self.shape)}, expected {list(expected)}")


class Checkpoint:
    """Base class: a mapping from HF tensor names to :class:`LazyTensor` plus the config.

    Attributes:
        path: the file or folder.
        observer: None, or ``callable(tensor: LazyTensor, index: tuple, out: torch.Tensor)`` told of
            every read of the tensors :meth:`get` returns after it was set (weight reloads record
            digests of what each rank read: ``workers/weight_reload.py``).
    """

    path: Path
    observer: Callable[[LazyTensor, tuple, torch.Tensor], None] | None = None

    def _lazy(self, name: str, file: str, shape: tuple[int, ...], read: Callable[[tuple], torch.Tensor],
              quant_type: str | None = None, quantized: Callable[[], object] | None = None,
              raw: Callable[[], torch.Tensor] | None = None) -> LazyTensor:
        """A :class:`LazyTensor` whose reads go past :attr:`observer` (when set). A read of the
        integer form (``quantized``) is told to the observer as index ``("integer form",)`` with
        ``raw()``, the tensor's bytes as stored."""
        tensor = LazyTensor(name, file, shape, read, quant_type, quantized)
        observer = self.observer
        if observer is not None:
            def observed(index: tuple) -> torch.Tensor:
                out = read(index)
                observer(tensor, index, out)
                return out

            tensor._read = observed
            if quantized is not None and raw is not None:
                def observed_quantized():
                    out = quantized()
                    observer(tensor, ("integer form",), raw())
                    return out

                tensor._quantized = observed_quantized
        return tensor

    def reopen(self, path: str | os.PathLike) -> None:
        """Read ``path`` (same format) from now on, keeping :attr:`observer`; the object stays the
        same, so loaders that hold it read the new files too.

        Raises:
            CheckpointError: ``path`` cannot be opened (this checkpoint is unchanged then).
        """
        fresh = self._open_like(path)
        vars(self).update({key: value for key, value in vars(fresh).items() if key != "observer"})

    def _open_like(self, path: str | os.PathLike) -> Checkpoint:
        return type(self)(path)

    def names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> LazyTensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def require(self, name: str, shape: tuple[int, ...] | None = None) -> LazyTensor:
        """Return tensor ``name``, checking that it exists and (optionally) has ``shape``.

        Raises:
            CheckpointError: the tensor is missing, or its shape differs from ``shape``.
        """
        if name not in self:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        tensor = self.get(name)
        if shape is not None:
            tensor.check_shape(shape)
        return tensor


def check_shard_name(folder: Path, fname) -> None:
    """A shard named by an index must be a file of ``folder`` itself: no path, no ``..``, no link out.
    Checked before the file system is asked whether it exists (the answer tells nothing of outside files).

    Raises:
        CheckpointError: it is not.
    """
    if not isinstance(fname, str) or not fname or fname in (".", "..") or Path(fname).name != fname \
            or "\\" in fname or "\x00" in fname:
        raise CheckpointError(f"{folder}: shard name {fname!r} in model.safetensors.index.json is not a file name "
                              "of the checkpoint folder")
    real_folder = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(folder / fname)) != real_folder:
        raise CheckpointError(f"{folder}: shard {fname!r} in model.safetensors.index.json links outside the "
                              "checkpoint folder")


class SafetensorsCheckpoint(Checkpoint):
    """A HF checkpoint folder: ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.

    Args:
        path: the checkpoint folder.

    Raises:
        CheckpointError: no safetensors file, a shard listed in the index is missing or is not a
            file of this folder (a path, ``..``, a link that leaves it), or a file is truncated /
            not a safetensors file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            for fname in files:
                check_shard_name(self.path, fname)
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
            weight_map = {}
        self._handles = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fpath = self.path / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: missing file (listed in {index_file.name})")
            try:
                handle = safe_open(str(fpath), framework="pt")
            except Exception as exc:  # safetensors raises SafetensorError / OSError
                raise CheckpointError(f"{fpath}: cannot read safetensors file ({exc}); is it truncated?") from exc
            self._handles[fname] = handle
            for key in handle.keys():
                self._where[key] = fname
        for key, fname in weight_map.items():
            if key not in self._where:
                raise CheckpointError(f"{self.path / fname}: missing tensor {key!r} (listed in {index_file.name})")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> LazyTensor:
        fname = self._where[name]
        fpath = str(self.path / fname)
        tslice = self._handles[fname].get_slice(name)
        shape = tuple(tslice.get_shape())

        def read(index: tuple) -> torch.Tensor:
            try:
                return tslice[index]
            except Exception as exc:
                raise CheckpointError(f"{fpath}: cannot read tensor {name!r} ({exc}); is the file truncated?") from exc

        return self._lazy(name, fpath, shape, read)


# GGUF tensor types that are plain arrays rather than quantized blocks.
_PLAIN_GGUF_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                     "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFTensor:
    """Where one tensor of a GGUF file lies, without holding the file open.

    Args:
        path: the ``.gguf`` file.
        entry: its row of the file's tensor table (:class:`workers.gguf_file.GGUFTensorEntry`).

    Attributes:
        name / tensor_type / n_elements: as in ``gguf.ReaderTensor``.
        shape: GGUF dims, fastest first. torch_shape: the reverse (row-major torch shape).
        nbytes: bytes of its data in the file.

    Raises:
        ValueError: its type is not a ``gguf.GGMLQuantizationType``.
    """

    __slots__ = ("path", "name", "tensor_type", "shape", "torch_shape", "n_elements", "nbytes", "_offset",
                 "_dtype", "_array_shape")

    def __init__(self, path: Path, entry) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path, self.name, self.tensor_type = path, entry.name, GGMLQuantizationType(entry.ggml_type)
        self.shape = tuple(int(d) for d in entry.dims)
        self.torch_shape = tuple(reversed(self.shape))
        self.n_elements = math.prod(self.shape)
        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        self.nbytes = self.n_elements * type_size // block_size
        self._offset = entry.offset
        # the layout gguf.GGUFReader gives: plain types as typed arrays, blocks as uint8 rows
        plain = _PLAIN_GGUF_TYPES.get(self.tensor_type.name)
        if plain is not None:
            self._dtype, self._array_shape = np.dtype(plain), self.torch_shape
        else:
            self._dtype = np.dtype(np.uint8)
            self._array_shape = tuple(quant_shape_to_byte_shape(self.torch_shape, self.tensor_type))

    def data(self) -> np.ndarray:
        """The tensor as stored, in ``GGUFReader``'s layout (blocks as uint8 rows for quantized
        types): a read-only memory map of this tensor alone, unmapped once no array refers to it,
        so a loaded rank keeps none of the file's pages."""
        return np.memmap(self.path, dtype=self._dtype, mode="r", offset=self._offset, shape=self._array_shape)


class GGUFCheckpoint(Checkpoint):
    """A GGUF file: its header read once per process (:func:`workers.gguf_file.read_header`), its
    tensors dequantized to float32 on read by the ``gguf`` package.

    llama.cpp's converter permutes the rows of Llama's Q and K projections (interleaved RoPE
    layout); reading ``q_proj``/``k_proj`` undoes that permutation so tensors match the HF
    checkpoint (same inverse as transformers' ``modeling_gguf_pytorch_utils.LlamaConverter``).

    Args:
        path: the ``.gguf`` file.
        num_heads / num_kv_heads: head counts, needed to undo the Q/K permutation.

    Raises:
        CheckpointError: the file is missing, truncated (a header cut short, or a tensor's data
            past the end of the file) or not GGUF; a tensor's quantization type has no
            dequantizer in the ``gguf`` package (raised when that tensor is read).
    """

    def __init__(self, path: str | os.PathLike, num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: missing file")
        try:
            # the header alone (workers/gguf_file.py), once per file and process: gguf.GGUFReader
            # would decode every metadata element, the vocabulary included (seconds per parse)
            header = read_header(self.path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot parse GGUF file ({type(exc).__name__}: {exc}); is it truncated?") from exc
        metadata = header.metadata
        self.arch = metadata.get("general.architecture")
        if self.arch not in GGUF_TO_HF:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not supported (known: {sorted(GGUF_TO_HF)})")
        self.num_heads = num_heads or metadata.get(f"{self.arch}.attention.head_count")
        self.num_kv_heads = num_kv_heads or metadata.get(f"{self.arch}.attention.head_count_kv", self.num_heads)
        self._tensors: dict[str, GGUFTensor] = {}
        for entry in header.tensors:
            try:
                tensor = GGUFTensor(self.path, entry)
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{self.path}: tensor {entry.name!r} has GGUF type {entry.ggml_type}, "
                                      f"unknown to the gguf package ({exc})") from exc
            if entry.offset + tensor.nbytes > header.file_size:
                raise CheckpointError(f"{self.path}: tensor {entry.name!r} ends at byte {entry.offset + tensor.nbytes}, "
                                      f"past the end of the file ({header.file_size} bytes); is it truncated?")
            hf_name = gguf_to_hf_name(self.arch, entry.name)
            if hf_name is not None:
                self._tensors[hf_name] = tensor
        self.tied_embeddings = "lm_head.weight" not in self._tensors

    def matrix_types(self) -> dict[str, int]:
        """Elements of the file's 2-D weights per GGUF type name (``{"Q4_1": 106168320, ...}``)."""
        counts: dict[str, int] = {}
        for tensor in self._tensors.values():
            if len(tensor.shape) == 2:
                counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + int(tensor.n_elements)
        return counts

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> LazyTensor:
        tensor = self._tensors[name]
        shape = tensor.torch_shape
        cache: dict[str, torch.Tensor] = {}

        def read(index: tuple) -> torch.Tensor:
            if "full" not in cache:
                cache["full"] = self._dequantize(name, tensor, shape)
            full = cache["full"]
            if index == (slice(None),):
                cache.clear()  # the caller owns the full tensor now
            return full[index]

        qtype = tensor.tensor_type.name
        if qtype in _PLAIN_GGUF_TYPES:
            return self._lazy(name, str(self.path), shape, read)
        quantized = None
        if qtype in PACKED_GGUF_TYPES and len(shape) == 2:
            quantized = lambda: self._integer_form(name, tensor, shape)  # noqa: E731
        return self._lazy(name, str(self.path), shape, read, qtype, quantized, raw=lambda: _stored_bytes(tensor))

    def _open_like(self, path: str | os.PathLike) -> GGUFCheckpoint:
        return GGUFCheckpoint(path, self.num_heads, self.num_kv_heads)

    def _integer_form(self, name: str, tensor, shape: tuple[int, ...]):
        try:
            weight = decode_gguf(tensor.data(), tensor.tensor_type.name, shape)
        except (ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r} cannot be read ({exc}); is the file truncated?") from exc
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = self.num_heads if "q_proj" in name else self.num_kv_heads
            weight = weight.take_rows(unpermute_llama_qk(torch.arange(shape[0])[:, None], heads)[:, 0])
        return weight

    def _dequantize(self, name: str, tensor, shape: tuple[int, ...]) -> torch.Tensor:
        from gguf import quants

        qtype = tensor.tensor_type
        try:
            if qtype.name in _PLAIN_GGUF_TYPES:
                array = tensor.data().view(_PLAIN_GGUF_TYPES[qtype.name]).astype(np.float32)
            else:
                array = quants.dequantize(tensor.data(), qtype)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name!r} ({name}) uses quantization type {qtype.name}, "
                f"which the gguf package cannot dequantize"
            ) from exc
        except (ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.path}: tensor {tensor.name!r} cannot be read ({exc}); is the file truncated?") from exc
        weight = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape)
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = self.num_heads if "q_proj" in name else self.num_kv_heads
            weight = unpermute_llama_qk(weight, heads)
        return weight


def _stored_bytes(tensor) -> torch.Tensor:
    """A GGUF tensor's bytes as stored (uint8, a view of the read-only memory map: only hashed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch warns that the array is not writable
        return torch.from_numpy(tensor.data().view(np.uint8).reshape(-1))


def unpermute_llama_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's ``convert_hf_to_gguf.py`` stores each head's rows as interleaved (even, odd) RoPE
    pairs; HF keeps the two halves of each head apart (``rotate_half``). Shape is unchanged:
    ``[num_heads * head_dim, in_features]``.
    """
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a ``.gguf`` file or a HF safetensors folder.

    Raises:
        CheckpointError: the path does not exist or is neither kind.
    """
    p = Path(path)
    if p.suffix == ".gguf":
        return GGUFCheckpoint(p)
    if p.is_dir():
        return SafetensorsCheckpoint(p)
    raise CheckpointError(f"{p}: missing file (expected a .gguf file or a folder with safetensors)")

