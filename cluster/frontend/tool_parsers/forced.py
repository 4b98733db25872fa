"""Calls the server made the model write: ``tool_choice`` naming a function (the answer is that
function's arguments JSON) or ``"required"`` (the answer is a JSON array of ``{"name",
"parameters"}``). Generation was constrained by the tools' schemas
(:func:`cluster.frontend.chat_request.tool_constraint`); these parsers only wrap the JSON as calls,
streaming the arguments as they are generated. Not in the ``--tool-call-parser`` registry.
"""

from __future__ import annotations

from collections.abc import Callable

from shardserve.cluster.frontend.tool_parsers.base import (
    WHITESPACE, BufferedParser, Malformed, ParseDelta, ToolParser, new_call_id, skip_ws)
from shardserve.cluster.frontend.tool_parsers.hermes import JsonCallStreamer


class NamedCallParser(ToolParser):
    """The whole answer is the arguments of ``function`` (leading whitespace dropped).

    Args:
        function: the function ``tool_choice`` named.
    """

    name = "named"
    needs_special_tokens = False

    def __init__(self, function: str, tools: dict[str, dict] | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tools, make_id)
        self.function = function

    def feed(self, text: str) -> ParseDelta:
        out = ParseDelta()
        if not self.num_calls:
            text = text.lstrip(WHITESPACE)
            if not text:
                return out
            self._start_call(out, self.function)
        self._args(out, text)
        return out

    def finish(self) -> ParseDelta:
        out = ParseDelta()
        if not self.num_calls:                 # nothing generated: a call with no arguments
            self._start_call(out, self.function)
            self._args(out, "{}")
        return out


class RequiredCallsParser(BufferedParser):
    """The answer is ``[{"name": ..., "parameters": {...}}, ...]``; each item is a call. Text that
    does not fit (only possible when the constraint was not applied) is content."""

    name = "required"
    needs_special_tokens = False

    def __init__(self, tools: dict[str, dict] | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tools, make_id)
        self._state = "start"
        self._streamer: JsonCallStreamer | None = None

    def _finish(self, out: ParseDelta) -> None:
        if self._state == "content" or (self._state == "start" and self._buf.strip(WHITESPACE)):
            out.content += self._buf

    def _run(self) -> ParseDelta:
        out = ParseDelta()
        while self._buf and self._state != "done":
            buf = self._buf
            if self._state == "content":
                out.content += buf
                self._buf = ""
                break
            if self._state == "item" and self._streamer is not None:
                try:
                    end = self._streamer.feed(self, out, buf, 0, self._final)
                except Malformed:
                    if self._streamer.started:
                        self._end_call()
                    self._state = "content" if not self.num_calls else "done"
                    continue
                self._buf = buf[end:]
                if not self._streamer.call.done:
                    break
                self._streamer, self._state = None, "after"
                continue
            i = skip_ws(buf, 0)
            if i == len(buf):
                self._buf = buf if self._state == "start" else ""
                break
            char = buf[i]
            if self._state == "start":
                self._state = "item_start" if char == "[" else "content"
                self._buf = buf[i + 1:] if char == "[" else buf
            elif self._state == "item_start" and char == "{":
                self._streamer, self._state, self._buf = JsonCallStreamer(), "item", buf[i:]
            elif self._state == "after" and char in ",]":
                self._state = "item_start" if char == "," else "done"
                self._buf = buf[i + 1:]
            else:
                self._state = "content" if not self.num_calls else "done"
        return out
