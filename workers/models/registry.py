"""Architecture name (HF ``config.architectures[0]``) -> model class."""

from __future__ import annotations

from shardserve.workers.models.deepseek_v32 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from shardserve.workers.models.llama import LlamaForCausalLM
from shardserve.workers.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def model_class(config) -> type:
    """The class that serves ``config``.

    Raises:
        ValueError: the architecture is not supported.
    """
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) == "llama":
        archs = ["LlamaForCausalLM"]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {archs or config.model_type!r}; supported: {sorted(MODEL_REGISTRY)}")
