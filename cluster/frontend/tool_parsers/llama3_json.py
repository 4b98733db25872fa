"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON calls, written as the whole answer::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The optional ``<|python_tag|>`` and several objects joined by ``;`` included. Calls count only at
the start of the answer (an answer that starts with prose is content, JSON inside it included);
an object that is not a call (no ``name``) makes the whole answer content. ``"arguments"`` is
accepted for ``"parameters"``. Format: Meta's Llama 3.1 model card ("JSON based tool calling")
and its ``chat_template``.
"""

from __future__ import annotations

from collections.abc import Callable

from shardserve.cluster.frontend.tool_parsers.base import BufferedParser, Malformed, ParseDelta, at, new_call_id, skip_ws
from shardserve.cluster.frontend.tool_parsers.hermes import JsonCallStreamer
from shardserve.cluster.frontend.tool_parsers.markup import PlainText

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(BufferedParser):
    """JSON calls at the start of the answer."""

    name = "llama3_json"

    def __init__(self, tools: dict[str, dict] | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tools, make_id)
        self._state = "start"
        self._raw = ""             # text held before the first call was announced
        self._streamer: JsonCallStreamer | None = None
        self._plain = PlainText(())

    def _finish(self, out: ParseDelta) -> None:
        if self._state == "start":               # only whitespace or a partial tag: plain text
            out.content += self._plain.text(self._raw + self._buf)
        elif self._state == "object" and self._streamer is not None and not self._streamer.started:
            self._end_call()                     # an unfinished object: a call cut short (dropped)
        self._raw = ""
        out.content += self._plain.flush()

    def _run(self) -> ParseDelta:
        out = ParseDelta()
        while self._buf:
            state, buf = self._state, self._buf
            if state in ("plain", "skip"):
                if state == "plain":
                    out.content += self._plain.text(buf)
                self._buf = ""
                break
            if state == "object":
                if not self._object(out):
                    break
                continue
            i = skip_ws(buf, 0)
            if state == "start":
                tag = at(buf, i, PYTHON_TAG)
                if tag is None and not self._final:
                    break
                if tag:
                    i = skip_ws(buf, tag)
                if i == len(buf) and not self._final:
                    break
                self._raw, self._buf = buf[:i], buf[i:]
                self._state = "object" if self._buf.startswith("{") else "plain"
                if self._state == "plain":
                    self._buf, self._raw = buf, ""
                continue
            # state == "after": a call ended; another may follow after a ';'
            if i == len(buf):
                self._buf = ""
                break
            if buf[i] == ";":
                j = skip_ws(buf, i + 1)
                if j == len(buf) and not self._final:
                    break
                if buf.startswith("{", j):
                    self._raw, self._buf, self._state = buf[:j], buf[j:], "object"
                    continue
            self._plain.block_ends()
            self._buf, self._state = buf[i:], "plain"
        return out

    def _object(self, out: ParseDelta) -> bool:
        """Feed the call object; False when it needs more text."""
        if self._streamer is None:
            self._streamer = JsonCallStreamer()
        try:
            end = self._streamer.feed(self, out, self._buf, 0, self._final)
        except Malformed:
            if self._streamer.started:          # broken JSON in an announced call: the answer ends there
                self._end_call()
                self._streamer, self._state, self._buf = None, "skip", ""
                return True
            self._buf, self._raw = self._raw + self._buf, ""   # not a call: content from its start
            self._streamer, self._state = None, "plain"
            return True
        if self._streamer.started:
            self._raw = ""
        else:
            self._raw += self._buf[:end]
        self._buf = self._buf[end:]
        if not self._streamer.call.done:
            return False
        self._streamer, self._state = None, "after"
        self._plain.block_ends()
        return True
