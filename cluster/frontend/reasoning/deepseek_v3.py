"""``deepseek_v3``: DeepSeek-V3.1 / V3.2 hybrid thinking. ``thinking=True`` in
``chat_template_kwargs`` makes the template end the prompt with ``<think>`` (the answer thinks up
to ``</think>``); chat mode ends it with ``</think>`` (no thinking). Format: DeepSeek-V3.1's
chat template, DeepSeek-V3.2's ``encoding_dsv32.py`` (``thinking_mode``)."""

from __future__ import annotations

from shardserve.cluster.frontend.reasoning.base import ReasoningParser


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"
