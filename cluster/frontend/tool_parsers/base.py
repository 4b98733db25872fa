"""What every tool-call parser shares: the delta types, the streaming contract, and the plain-text
state that finds where call markup starts.

A parser is a pure function of the model's text. It is an object fed the text deltas as they come
(:meth:`ToolParser.feed`) and told when the text ends (:meth:`ToolParser.finish`); each call
returns a :class:`ParseDelta`: plain content, and pieces of tool calls in OpenAI's streaming shape
(a call's ``index``, ``id`` and ``name`` on its first piece only, then ``arguments`` fragments that
concatenate to the call's arguments JSON). A non-streamed answer is the same parser fed the whole
text at once (:func:`parse_text`), so streamed and non-streamed results agree by construction,
wherever the text was split (a marker split across deltas, several tokens in one delta).

Rules every family follows (tests/cluster/test_tool_parsers.py checks them on one table):

- Text that could still become a marker is held back until it cannot (a marker split across
  deltas never leaks into content); at the end it is released as the text it is.
- Markup inside markdown code in plain content (a ``` fence, or an inline `span` on one line) is
  content, never a call.
- Whitespace next to a call block is dropped; text with no call is returned exactly.
- Markup that turns out malformed before a call was announced is returned as content, from its
  start marker on. Once a call was announced (its name known) it stays a call: its arguments are
  what the model wrote (OpenAI's contract: clients validate them), and text cut by the end of the
  output (``finish_reason: "length"``) leaves the arguments unfinished.
- A parser never raises on model text.

Source of the streaming shape: OpenAI's ``chat.completion.chunk`` (``choices[].delta.tool_calls``);
the idea of pure, per-family parsers from vLLM's ``vllm/tool_parsers`` (not its code).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"


def registered(registry: dict, name: str, what: str):
    """``registry[name]`` of a parser registry (``what``: its flag's words, e.g. "tool call parser").

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(sorted(registry))}") from None


def new_call_id() -> str:
    """A tool-call id as OpenAI spells them (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallDelta:
    """A piece of one streamed tool call (one entry of OpenAI's ``delta.tool_calls``).

    Attributes:
        index: which call of the answer (0, 1, ...).
        arguments: the next fragment of the call's arguments JSON ("" on a first piece).
        id: the call's id, on its first piece only.
        name: the function name, on its first piece only.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParseDelta:
    """What one feed produced: plain content, then call pieces, in order of the text."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add(self, other: ParseDelta) -> ParseDelta:
        """Append ``other`` (adjacent argument fragments of one call are merged)."""
        self.content += other.content
        for piece in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == piece.index and piece.id is None:
                last.arguments += piece.arguments
            else:
                self.calls.append(CallDelta(piece.index, piece.arguments, piece.id, piece.name))
        return self


@dataclass(slots=True)
class ToolCall:
    """A finished call (``message.tool_calls[]``): ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedText:
    """A whole answer split by a parser: ``content`` without markup, and the calls in order."""

    content: str
    calls: list[ToolCall]


def collect(deltas: list[ParseDelta]) -> ParsedText:
    """Join a stream of deltas into the finished answer (what a client assembles)."""
    content, calls = [], {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.calls:
            if piece.index not in calls:
                calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
            calls[piece.index].arguments += piece.arguments
    return ParsedText("".join(content), [calls[i] for i in sorted(calls)])


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of some marker (to hold back)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


class ToolParser:
    """A streaming tool-call parser for one answer (subclasses: one per model family).

    Args:
        tools: function name -> its ``parameters`` JSON schema (type hints for formats that write
            values as plain text; None = unknown).
        make_id: makes call ids (default :func:`new_call_id`).
    """

    name = ""                        # the --tool-call-parser name
    needs_special_tokens = True      # decode special tokens: the markers may be special tokens

    def __init__(self, tools: dict[str, dict] | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        self.tools = tools or {}
        self._make_id = make_id
        self.num_calls = 0
        self._open: int | None = None   # index of the call being written

    # -- the contract --------------------------------------------------------------------------
    def feed(self, text: str) -> ParseDelta:
        """Parse the next text delta; returns what can be told now."""
        raise NotImplementedError

    def finish(self) -> ParseDelta:
        """The text has ended: release what was held back and close what is open."""
        raise NotImplementedError

    # -- helpers for subclasses ----------------------------------------------------------------
    def _start_call(self, out: ParseDelta, name: str) -> None:
        self._open = self.num_calls
        self.num_calls += 1
        out.calls.append(CallDelta(self._open, "", self._make_id(), name))

    def _args(self, out: ParseDelta, fragment: str) -> None:
        if fragment and self._open is not None:
            out.add(ParseDelta(calls=[CallDelta(self._open, fragment)]))

    def _end_call(self) -> None:
        self._open = None


class BufferedParser(ToolParser):
    """A parser that keeps the text it could not tell yet in ``_buf`` and parses it in ``_run``
    (``_final`` is set for the last run); ``_finish`` then handles what is left."""

    def __init__(self, tools: dict[str, dict] | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tools, make_id)
        self._buf = ""
        self._final = False

    def feed(self, text: str) -> ParseDelta:
        self._buf += text
        return self._run()

    def finish(self) -> ParseDelta:
        self._final = True
        out = self._run()
        self._finish(out)
        self._buf = ""
        return out

    def _run(self) -> ParseDelta:
        raise NotImplementedError

    def _finish(self, out: ParseDelta) -> None:
        """The text ended: add to ``out`` what ``_run`` left in ``_buf`` or open."""


def parse_text(parser: ToolParser, text: str) -> ParsedText:
    """A whole answer through ``parser`` (the non-streamed path)."""
    return collect([parser.feed(text), parser.finish()])


class Malformed(Exception):
    """Raised by a block parser when the block cannot be a call (before a call was announced)."""


def skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in WHITESPACE:
        i += 1
    return i


def at(buf: str, i: int, literal: str) -> int | bool | None:
    """Whether ``buf[i:]`` starts with ``literal``: its end index when it does, None when ``buf``
    ends inside a prefix of it (wait for more), False when it does not."""
    rest = buf[i:i + len(literal)]
    if rest == literal:
        return i + len(literal)
    return None if literal.startswith(rest) else False
