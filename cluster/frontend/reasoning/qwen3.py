"""``qwen3``: Qwen3 / QwQ / Qwen3.5. The model writes ``<think>`` (Qwen3 up to the 2507 release) or
the template opens it (Qwen3.5, thinking-only models); ``enable_thinking=False`` writes an empty
``<think>\\n\\n</think>\\n\\n`` into the prompt. Format: Qwen/Qwen3-8B ``chat_template``."""

from __future__ import annotations

from shardserve.cluster.frontend.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
