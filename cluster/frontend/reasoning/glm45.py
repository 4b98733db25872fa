"""``glm45``: GLM-4.5 / 4.6 / 4.7 / GLM-5. GLM-4.5 writes ``<think>`` itself; GLM-4.7 and GLM-5
templates open it in the prompt; ``enable_thinking=False`` closes it there (``<think></think>``).
Format: zai-org/GLM-4.5 and GLM-5 ``chat_template.jinja``."""

from __future__ import annotations

from shardserve.cluster.frontend.reasoning.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
