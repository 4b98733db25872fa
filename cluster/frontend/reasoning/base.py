"""What the reasoning parsers share: splitting ``<think>...</think>`` from the answer, streamed.

A parser is fed the answer's text deltas (:meth:`ReasoningParser.feed`) and told when it ends
(:meth:`ReasoningParser.finish`); each returns a :class:`ReasoningDelta` (thinking text, answer
text). A non-streamed answer is the same parser fed the whole text, so streamed and non-streamed
results agree wherever the text was split.

Where the answer starts, in thinking or not, is read from the end of the rendered prompt first:
templates that open the thinking block themselves end the prompt with ``<think>`` (DeepSeek-V3.1 /
V3.2 thinking mode, DeepSeek-R1, GLM-4.7 / GLM-5, Qwen3.5), and templates with thinking switched
off end it with ``</think>`` (DeepSeek chat mode, Qwen3 ``enable_thinking=False``, GLM
``enable_thinking=False``). Otherwise ``thinking=False`` from the request (``chat_template_kwargs``)
means no thinking; else the family's default applies: DeepSeek-R1 thinks even without writing
``<think>``, the others think when the answer starts with ``<think>``.

Rules: markers split across deltas never leak (held back until they cannot be one); whitespace
just inside the thinking block and just after it is dropped; an answer cut inside the thinking
block (``finish_reason: "length"``) is all thinking; a ``<think>`` later in the answer is text.
Source of the behaviour: vLLM's ``deepseek_r1``, ``deepseek_v3``, ``glm45`` and ``qwen3``
reasoning parsers (the idea, not the code).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.cluster.frontend.tool_parsers.base import WHITESPACE, partial_marker

START, END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    """Text of one feed: ``reasoning`` (thinking) and ``content`` (the answer)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one answer's thinking from its content.

    Args:
        prompt: the rendered prompt text (its end tells whether the answer starts in thinking);
            None = unknown.
        thinking: the request's ``thinking`` / ``enable_thinking`` template argument, if given.
    """

    name = ""
    thinks_without_start = False     # the model may omit <think> (the template wrote it)
    needs_special_tokens = True      # decode special tokens: <think> may be one

    def __init__(self, prompt: str | None = None, thinking: bool | None = None) -> None:
        tail = (prompt or "").rstrip(WHITESPACE)
        if tail.endswith(START):
            self._state = "thinking"
        elif tail.endswith(END) or thinking is False:
            self._state = "content"
        else:
            self._state = "thinking" if self.thinks_without_start else "maybe"
        self._buf = ""
        self._at_start = True        # nothing of the thinking block told yet
        self._ws = ""                # whitespace inside the thinking block, not told yet
        self._final = False

    @property
    def thinking(self) -> bool:
        """The answer is inside its thinking block now."""
        return self._state in ("thinking", "maybe")

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run()

    def finish(self) -> ReasoningDelta:
        self._final = True
        out = self._run()
        if self._buf:                 # a partial marker that never completed
            if self._state == "thinking":
                out.reasoning += self._ws + self._buf
            else:
                out.content += self._buf
        self._buf = self._ws = ""
        return out

    def _run(self) -> ReasoningDelta:
        out = ReasoningDelta()
        while self._buf:
            buf = self._buf
            if self._state == "content":
                out.content += buf
                self._buf = ""
            elif self._state == "after":     # just after </think>: drop whitespace
                body = buf.lstrip(WHITESPACE)
                self._buf = body
                if body:
                    self._state = "content"
            elif self._state == "maybe":
                body = buf.lstrip(WHITESPACE)
                if len(body) < len(START) and START.startswith(body) and not self._final:
                    break
                if body.startswith(START):
                    self._buf, self._state = body[len(START):], "thinking"
                else:
                    self._state = "content"
            elif not self._thinking(out):
                break
        return out

    def _thinking(self, out: ReasoningDelta) -> bool:
        """Inside the thinking block; False when the rest must wait."""
        buf = self._buf
        if self._at_start:
            body = buf.lstrip(WHITESPACE)
            if not body:
                self._buf = ""
                return False
            if len(body) < len(START) and START.startswith(body) and not self._final:
                self._buf = body
                return False
            buf = body[len(START):].lstrip(WHITESPACE) if body.startswith(START) else body
            if not buf:
                self._buf = ""
                return False
            self._at_start = False
        end = buf.find(END)
        if end != -1:
            out.reasoning += self._hold_ws(buf[:end])
            self._ws, self._buf, self._state = "", buf[end + len(END):], "after"
            return True
        keep = partial_marker(buf, (END,))
        out.reasoning += self._hold_ws(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _hold_ws(self, piece: str) -> str:
        body = piece.rstrip(WHITESPACE)
        if not body:
            self._ws += piece
            return ""
        out = self._ws + body
        self._ws = piece[len(body):]
        return out


def parse_reasoning(parser: ReasoningParser, text: str) -> ReasoningDelta:
    """A whole answer through ``parser`` (the non-streamed path)."""
    first, last = parser.feed(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
