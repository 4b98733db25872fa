"""Is a checkpoint a drop-in replacement for the one being served? (checked before a weight reload)

A weight reload keeps the model object, its parallel layout and its caches' shapes, so the new
files must describe the same model: the same architecture and vocabulary, the same configuration
(a changed ``rope_theta`` or layer count needs a restart, not a reload), every tensor the served
model reads with the same shape, and every file readable and complete. The served side is a
:class:`CheckpointManifest` of what the replica loaded (its configuration and the shapes its ranks
read), so files overwritten in place are compared with what was loaded, not with themselves.

Every refusal is a :class:`workers.checkpoint.CheckpointError` whose message names the first bad
tensor (or the configuration field, or the file).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from shardserve.workers.checkpoint import CheckpointError, check_shard_name, open_checkpoint
from shardserve.workers.model_source import ModelFiles, load_config

# Configuration keys that describe the files, not the model.
_METADATA_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                  "architectures", "model_type", "vocab_size"}


@dataclass(slots=True)
class CheckpointManifest:
    """What a checkpoint holds, without its data.

    Attributes:
        path: the ``.gguf`` file or checkpoint folder.
        architectures: ``config.architectures`` (or ``[model_type]`` when absent).
        vocab_size: ``config.vocab_size``.
        config: the rest of the configuration (``to_dict()`` minus metadata and ``shardserve_*``).
        shapes: tensor name -> shape, in file order.
    """

    path: Path
    architectures: list[str]
    vocab_size: int
    config: dict
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def from_config(cls, path: Path, hf_config, shapes: dict[str, tuple[int, ...]]) -> CheckpointManifest:
        """A manifest from a loaded configuration and the shapes of the tensors (e.g. those the
        ranks read while loading: the served model)."""
        raw = {key: value for key, value in hf_config.to_dict().items()
               if key not in _METADATA_KEYS and not key.startswith("shardserve_")}
        architectures = list(getattr(hf_config, "architectures", None) or [hf_config.model_type])
        return cls(Path(path), architectures, int(hf_config.vocab_size), raw, dict(shapes))

    @classmethod
    def read(cls, files: ModelFiles) -> CheckpointManifest:
        """Read configuration and tensor headers (no tensor data).

        Raises:
            CheckpointError: a file is truncated or unreadable (naming the first tensor past its end).
            ValueError / OSError: the configuration cannot be parsed.
        """
        if not files.is_gguf:
            check_complete(files.path)
        ckpt = open_checkpoint(files.path)   # a GGUF file is checked by parsing it
        shapes = {name: tuple(ckpt.get(name).shape) for name in ckpt.names()}
        return cls.from_config(files.path, load_config(files), shapes)

    def check_replacement(self, new: CheckpointManifest) -> None:
        """Raises :class:`CheckpointError` when ``new`` cannot replace this checkpoint's weights
        in place; the message names the first difference."""
        if new.architectures != self.architectures:
            raise CheckpointError(f"{new.path}: a checkpoint of another architecture ({', '.join(new.architectures)}); "
                                  f"the replica serves {', '.join(self.architectures)}")
        if new.vocab_size != self.vocab_size:
            raise CheckpointError(f"{new.path}: vocab_size {new.vocab_size} differs from the served {self.vocab_size}")
        for key in sorted(set(self.config) | set(new.config)):
            if self.config.get(key) != new.config.get(key):
                raise CheckpointError(f"{new.path}: config field {key!r} is {new.config.get(key)!r}, the served model "
                                      f"has {self.config.get(key)!r}; a weight reload keeps the configuration "
                                      "(restart the replica to change it)")
        for name, shape in self.shapes.items():
            if name not in new.shapes:
                raise CheckpointError(f"{new.path}: missing tensor {name!r}")
            if new.shapes[name] != shape:
                raise CheckpointError(f"{new.path}: tensor {name!r} has shape {list(new.shapes[name])}, "
                                      f"the served one {list(shape)}")


def check_complete(path: str | Path) -> None:
    """Check that every safetensors file under ``path`` holds all the bytes its header promises
    (a GGUF file is checked by reading its header and tensor table).

    Raises:
        CheckpointError: a file is missing, its header is unreadable, or it is truncated (naming
            the first tensor whose data lies past the end of the file).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        open_checkpoint(path)    # its header reader checks every tensor's bytes lie in the file
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for name in files:
            check_shard_name(path, name)
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    for name in files:
        _check_safetensors_file(path / name)


def _check_safetensors_file(file: Path) -> None:
    """Header format: little-endian u64 header length, JSON header, then the data; each tensor's
    ``data_offsets`` are relative to the end of the header."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing file")
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if 8 + header_len > size:
                raise CheckpointError(f"{file}: the header needs {8 + header_len} bytes, the file has {size} "
                                      "(truncated?)")
            header = json.loads(handle.read(header_len))
    except (struct.error, ValueError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors header ({exc})") from exc
    tensors = sorted(((meta["data_offsets"][1], name) for name, meta in header.items() if name != "__metadata__"))
    for end, name in tensors:
        if 8 + header_len + end > size:
            raise CheckpointError(f"{file}: tensor {name!r} ends at byte {8 + header_len + end}, the file has "
                                  f"{size} bytes (truncated or still being written?)")
