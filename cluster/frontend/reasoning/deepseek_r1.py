"""``deepseek_r1``: DeepSeek-R1 (and its distills). The template opens the thinking block
(``<｜Assistant｜><think>\\n``), so the answer is thinking up to ``</think>`` even when the model
does not write ``<think>`` itself. Format: deepseek-ai/DeepSeek-R1 ``tokenizer_config.json``."""

from __future__ import annotations

from shardserve.cluster.frontend.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_without_start = True
