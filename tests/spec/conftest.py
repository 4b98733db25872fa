"""Fixtures for the speculative-decoding tests: tiny DeepSeek-V3.2 / GLM-5 checkpoints with one MTP
layer and a word-level tokenizer, written once per session."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))  # tiny_checkpoints, plan_driver

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

# DeepSeek-V3.2 stores its own MTP embedding / head copies; the GLM checkpoint does not (the MTP
# falls back to the main model's), so both loading paths are covered.
OWN_HEAD = {"deepseek_v32": True, "glm_moe_dsa": False}


@dataclass
class MtpCheckpoint:
    """A tiny checkpoint with an MTP layer and the transformers model of its main layers."""

    arch: str
    path: Path
    hf: object


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    """``mtp_checkpoint(arch) -> MtpCheckpoint`` (seed 0), each written once per session."""
    cache: dict[str, MtpCheckpoint] = {}

    def get(arch: str) -> MtpCheckpoint:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-mtp")
            hf = write_tiny_checkpoint(arch, path, seed=0, mtp=True, mtp_own_head=OWN_HEAD[arch], tokenizer=True)
            cache[arch] = MtpCheckpoint(arch, path, hf)
        return cache[arch]

    return get


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread. With two, every tiny op pays an OpenMP fork/join, which
    costs milliseconds on a loaded 2-core machine (measured: a [3, 5] softmax 1.5 ms vs 1.3 us)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
