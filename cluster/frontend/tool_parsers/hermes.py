"""``hermes``: calls as JSON objects in ``<tool_call>`` blocks (Hermes 2/3, Qwen2.5, Qwen3, SmolLM3
and every chat template written in that style)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several blocks (or several objects in one block) are several calls. Arguments stream as the raw
JSON the model writes; arguments written as a JSON string holding JSON are decoded.
Format: NousResearch Hermes function-calling prompt, Qwen2.5 / Qwen3 ``chat_template``.
"""

from __future__ import annotations

from shardserve.cluster.frontend.tool_parsers.base import Malformed, ParseDelta, partial_marker, skip_ws
from shardserve.cluster.frontend.tool_parsers.json_call import JsonCall
from shardserve.cluster.frontend.tool_parsers.markup import MarkupParser

START, END = "<tool_call>", "</tool_call>"


class JsonCallStreamer:
    """Streams one :class:`JsonCall` into a parser's deltas (shared by the JSON-call families)."""

    def __init__(self) -> None:
        self.call = JsonCall()
        self.started = False
        self._sent = 0

    def feed(self, parser, out: ParseDelta, buf: str, i: int, final: bool) -> int:
        """Feed ``buf[i:]``; announces the call once named and streams its arguments. Returns
        where it stopped.

        Raises:
            Malformed: not JSON (check :attr:`started`: was the call announced already?).
        """
        call = self.call
        while True:
            try:
                end = call.feed(buf, i, final)
            except Malformed:
                if self.started and not call.args_is_string:   # what came before the fault still counts
                    parser._args(out, call.args_raw[self._sent:])
                    self._sent = len(call.args_raw)
                raise
            if call.name is not None and not self.started:
                parser._start_call(out, call.name)
                self.started = True
            if call.done or end >= len(buf) or end == i:
                break
            i = end
        if self.started and not call.args_is_string:
            parser._args(out, call.args_raw[self._sent:])
            self._sent = len(call.args_raw)
        if call.done:
            if call.args_is_string or not call.args_raw:
                parser._args(out, call.arguments())
            parser._end_call()
        return end


class HermesToolParser(MarkupParser):
    """``<tool_call>{json}</tool_call>`` blocks."""

    name = "hermes"
    start_markers = (START,)

    def _enter_block(self, marker: str) -> None:
        self._state, self._streamer = "object", None

    def _block(self, out: ParseDelta) -> int:
        buf, i = self._buf, 0
        while True:
            if self._state == "skip":      # after broken JSON in an announced call: drop to the end tag
                at = buf.find(END, i)
                if at == -1:
                    return len(buf) - partial_marker(buf, (END,))
                self._in_block = False
                return at + len(END)
            if self._state == "object":
                if self._streamer is None:
                    i = skip_ws(buf, i)
                    if i == len(buf):
                        return i
                    self._streamer = JsonCallStreamer()
                try:
                    i = self._streamer.feed(self, out, buf, i, self._final)
                except Malformed:
                    if not self._streamer.started and not self.block_has_calls():
                        raise
                    self._end_call()
                    self._state = "skip"          # the block made calls: its broken rest is dropped
                    continue
                if not self._streamer.call.done:
                    return i
                self._state, self._streamer = "close", None
            i = skip_ws(buf, i)
            if i == len(buf):
                return i
            if buf[i] == "{":                # another object in the same block
                self._state = "object"
                continue
            rest = buf[i:i + len(END)]
            if rest == END:
                self._in_block = False
                return i + len(END)
            if END.startswith(rest) and not self._final:
                return i
            self._in_block = False           # no end tag: the block ends here
            return i
