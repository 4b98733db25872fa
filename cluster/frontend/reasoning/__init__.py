"""Reasoning parsers, one module per model family, and their registry (``--reasoning-parser NAME``,
vLLM's names): they split the thinking block from the answer (see :mod:`.base`). Pure functions of
text; none imports the engine.
"""

from __future__ import annotations

from shardserve.cluster.frontend.reasoning.base import ReasoningDelta, ReasoningParser, parse_reasoning
from shardserve.cluster.frontend.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from shardserve.cluster.frontend.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser
from shardserve.cluster.frontend.reasoning.glm45 import Glm45ReasoningParser
from shardserve.cluster.frontend.reasoning.qwen3 import Qwen3ReasoningParser
from shardserve.cluster.frontend.tool_parsers.base import registered

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {cls.name: cls for cls in (
    DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser, Glm45ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser_names() -> list[str]:
    """Every accepted ``--reasoning-parser`` name, sorted."""
    return sorted(REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    return registered(REASONING_PARSERS, name, "reasoning parser")


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "get_reasoning_parser", "parse_reasoning",
           "reasoning_parser_names"]
