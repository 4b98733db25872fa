"""Tool-call parsers, one module per model family, and their registry (``--tool-call-parser NAME``,
vLLM's names). Each is a pure function of the model's text (see :mod:`.base` for the contract);
none imports the engine, and the engine imports none of them.
"""

from __future__ import annotations

from shardserve.cluster.frontend.tool_parsers.base import (
    CallDelta, ParseDelta, ParsedText, ToolCall, ToolParser, collect, new_call_id, parse_text, registered)
from shardserve.cluster.frontend.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from shardserve.cluster.frontend.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from shardserve.cluster.frontend.tool_parsers.glm45 import Glm45ToolParser
from shardserve.cluster.frontend.tool_parsers.hermes import HermesToolParser
from shardserve.cluster.frontend.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (
    DeepSeekV32ToolParser, DeepSeekV31ToolParser, DeepSeekV3ToolParser, Glm45ToolParser, HermesToolParser,
    Llama3JsonToolParser)}
TOOL_PARSERS["glm47"] = Glm45ToolParser     # vLLM's name for GLM-4.7's newline-free spelling


def tool_parser_names() -> list[str]:
    """Every accepted ``--tool-call-parser`` name, sorted."""
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    return registered(TOOL_PARSERS, name, "tool call parser")


__all__ = ["CallDelta", "ParseDelta", "ParsedText", "TOOL_PARSERS", "ToolCall", "ToolParser", "collect",
           "get_tool_parser", "new_call_id", "parse_text", "tool_parser_names"]
