"""Fixtures for the DeepSeek-family parity tests: tiny checkpoints written once per session."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # sibling helpers (tiny_checkpoints, plan_driver)

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402


@dataclass
class TinyModel:
    """A tiny checkpoint on disk and the transformers model that wrote it (the oracle)."""

    arch: str
    path: Path
    hf: object


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch) -> TinyModel``, each architecture written once per session (seed 0)."""
    cache: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in cache:
            path = tmp_path_factory.mktemp(arch)
            cache[arch] = TinyModel(arch, path, write_tiny_checkpoint(arch, path, seed=0))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def qwen3_next(tmp_path_factory) -> TinyModel:
    """The tiny Qwen3-Next checkpoint (seed 0) with the word-level test tokenizer, written once."""
    path = tmp_path_factory.mktemp("qwen3_next")
    return TinyModel("qwen3_next", path, write_tiny_checkpoint("qwen3_next", path, seed=0, tokenizer=True))
