"""Shared fixtures: the real SmolLM2 GGUF (fetched once into the shardserve cache), our engine on
it, and transformers' model on the same file as the oracle."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_files():
    from workers.model_source import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_files):
    from cluster.config import EngineArgs
    from cluster.llm import LLM

    return LLM(EngineArgs(model=str(smollm2_files.path), kv_cache_gib=0.25), progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_files):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_files.folder), gguf_file=smollm2_files.path.name,
                                                 dtype=torch.float32)
    return model.eval()
