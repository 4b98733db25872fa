"""Conformance of every reasoning parser on one table: where the thinking block starts (the end
of the rendered prompt, or ``<think>`` in the answer), what is thinking and what is the answer,
thinking switched off, an answer cut inside the thinking block; each text parsed whole, split at
every position, and char by char. The oracle is the table. Pure Python, no model."""

from __future__ import annotations

import pytest

from shardserve.cluster.frontend.reasoning import REASONING_PARSERS, get_reasoning_parser, parse_reasoning

# (family, rendered prompt's end, thinking kwarg, answer text, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "<｜Assistant｜><think>\n", None, "Let me think.\n</think>\n\nThe answer is 4.",
     "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<｜Assistant｜>", None, "<think>\nhmm\n</think>\n\nYes.", "hmm", "Yes."),
    ("deepseek_r1", "<｜Assistant｜>", None, "no start tag </think> x", "no start tag", "x"),
    ("deepseek_v3", "<｜Assistant｜><think>", True, "步骤一\n步骤二</think>答案：42", "步骤一\n步骤二", "答案：42"),
    ("deepseek_v3", "<｜Assistant｜></think>", False, "Hi <think>x</think>", "", "Hi <think>x</think>"),
    ("deepseek_v3", "<｜Assistant｜>", None, "plain answer", "", "plain answer"),
    ("deepseek_v3", "<｜Assistant｜><think>", True, "cut inside the thinki", "cut inside the thinki", ""),
    ("qwen3", "<|im_start|>assistant\n", None, "<think>\n思考 < 1 </thin\n</think>\n\n答案 <think>", "思考 < 1 </thin",
     "答案 <think>"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, "Direct answer.", "", "Direct answer."),
    ("qwen3", "<|im_start|>assistant\n", None, "No thinking</think> here", "", "No thinking</think> here"),
    ("qwen3", "<|im_start|>assistant\n", False, "<think>x</think>y", "", "<think>x</think>y"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, "Qwen3.5 style</think>\n\nok", "Qwen3.5 style", "ok"),
    ("glm45", "<|assistant|>", None, "<think>abc</think>\ndef", "abc", "def"),
    ("glm45", "<|assistant|><think>", None, "GLM-5 thinks</think>def", "GLM-5 thinks", "def"),
    ("glm45", "<|assistant|>\n<think></think>", False, "no thinking", "", "no thinking"),
    ("glm45", "<|assistant|>", None, "<think>", "", ""),
]


def split_results(family, prompt, thinking, pieces):
    parser = get_reasoning_parser(family)(prompt, thinking)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("family,prompt,thinking,text,reasoning,content", CASES)
def test_thinking_splits_the_same_whole_and_anywhere(family, prompt, thinking, text, reasoning, content):
    whole = parse_reasoning(get_reasoning_parser(family)(prompt, thinking), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert split_results(family, prompt, thinking, [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert split_results(family, prompt, thinking, list(text)) == (reasoning, content)


def test_registry_names_and_unknown_name():
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "deepseek_v3", "glm45", "qwen3"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose one of: deepseek_r1"):
        get_reasoning_parser("r2")
