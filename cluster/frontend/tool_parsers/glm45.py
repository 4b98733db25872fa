"""``glm45``: GLM-4.5 / GLM-4.6 / GLM-4.7 / GLM-5 calls, one ``<tool_call>`` block each::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Beijing</arg_value>
    </tool_call>

GLM-4.7 and GLM-5 write the same without the newlines (``<tool_call>get_weather<arg_key>...``).
Values are plain text: a string parameter (by the tool's schema) streams as written; any other
value is JSON when it parses as JSON, else the text as a string.
Format: the ``chat_template.jinja`` of zai-org/GLM-4.5 and GLM-5 (``tool_call`` rendering).
"""

from __future__ import annotations

from shardserve.cluster.frontend.tool_parsers.base import Malformed, ParseDelta, at, partial_marker, skip_ws
from shardserve.cluster.frontend.tool_parsers.markup import KeyedArguments, MarkupParser

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_NAME_ENDS = ("\n", KEY, END)
_NAME_LIMIT = 256


class Glm45ToolParser(MarkupParser):
    """``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`` blocks."""

    name = "glm45"
    start_markers = (START,)

    def _enter_block(self, marker: str) -> None:
        self._state, self._keyed, self._key = "name", None, ""

    def _block(self, out: ParseDelta) -> int:
        buf, i = self._buf, 0
        while True:
            state = self._state
            if state == "name":
                return self._name(out, buf)
            if state in ("key", "value"):
                end_tag = KEY_END if state == "key" else VALUE_END
                end = buf.find(end_tag, i)
                stop = end if end != -1 else len(buf) - partial_marker(buf[i:], (end_tag,))
                if state == "key":
                    self._key += buf[i:stop]
                elif stop > i:
                    self._keyed.text(out, buf[i:stop])
                if end == -1:
                    return stop
                i = end + len(end_tag)
                if state == "key":
                    self._state = "before_value"
                else:
                    self._keyed.end(out)
                    self._state = "args"
                continue
            i = skip_ws(buf, i)
            if i == len(buf):
                return i
            if state == "before_value":
                end = at(buf, i, VALUE)
                if end is None:
                    return i
                if end is False:                  # a key without a value: skip it
                    self._state = "args"
                    continue
                self._keyed.begin(out, self._key.strip(), None)
                self._state, i = "value", end
                continue
            # state == "args": the next key, or the end of the call
            end = at(buf, i, KEY)
            if end is None:
                return i
            if end is not False:
                self._state, self._key, i = "key", "", end
                continue
            end = at(buf, i, END)
            if end is None:
                return i
            if end is False:
                i += 1                            # stray text inside the call: not part of it
                continue
            self._keyed.close(out)
            self._end_call()
            self._in_block = False
            return end

    def _name(self, out: ParseDelta, buf: str) -> int:
        ends = [(buf.find(mark), mark) for mark in _NAME_ENDS]
        ends = [(pos, mark) for pos, mark in ends if pos != -1]
        if not ends:
            if len(buf) > _NAME_LIMIT:
                raise Malformed("no function name")
            return 0
        pos, mark = min(ends)
        name = buf[:pos].strip()
        if not name or len(name) > _NAME_LIMIT or any(c in name for c in '{}<>"'):
            raise Malformed("not a function name")
        self._start_call(out, name)
        self._keyed = KeyedArguments(self, name)
        self._state = "args"
        return pos + (len(mark) if mark == "\n" else 0)
