"""``deepseek_v32``: DeepSeek-V3.2's DSML markup::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"`` values are the string as written (no quotes, no escaping); ``string="false"``
values are JSON (numbers, booleans, arrays, objects). A value whose schema type disagrees with
its ``string`` attribute is typed by the schema where it can be. The arguments JSON is built
parameter by parameter; string values stream as they are generated.
Format: DeepSeek-V3.2's ``encoding/encoding_dsv32.py`` (``tool_calls_template``,
``tool_call_template``, ``encode_arguments_to_dsml``).
"""

from __future__ import annotations

import re

from shardserve.cluster.frontend.tool_parsers.base import Malformed, ParseDelta, at, partial_marker, skip_ws
from shardserve.cluster.frontend.tool_parsers.markup import KeyedArguments, MarkupParser

DSML = "｜DSML｜"
START = f"<{DSML}function_calls>"
END = f"</{DSML}function_calls>"
INVOKE = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
_INVOKE_HEAD = re.compile(r'\s+name="([^"<>\n]+)"\s*>')
_PARAM_HEAD = re.compile(r'\s+name="([^"<>\n]+)"(?:\s+string="(true|false)")?\s*>')
_HEAD_LIMIT = 512        # characters a tag's attributes may take before the tag counts as broken


class DeepSeekV32ToolParser(MarkupParser):
    """DSML ``function_calls`` blocks."""

    name = "deepseek_v32"
    start_markers = (START,)

    def _enter_block(self, marker: str) -> None:
        self._state, self._keyed = "between", None

    def _block(self, out: ParseDelta) -> int:
        buf, i = self._buf, 0
        while True:
            state = self._state
            if state == "value":
                end = buf.find(PARAM_END, i)
                stop = end if end != -1 else len(buf) - partial_marker(buf[i:], (PARAM_END,))
                if stop > i:
                    self._keyed.text(out, buf[i:stop])
                if end == -1:
                    return stop
                self._keyed.end(out)
                self._state, i = "params", end + len(PARAM_END)
                continue
            i = skip_ws(buf, i)
            if i == len(buf):
                return i
            if state == "between":
                end = at(buf, i, INVOKE)
                if end is None:
                    return i
                if end is not False:
                    head = self._head(buf, end, _INVOKE_HEAD)
                    if head is None:
                        return i
                    if head is not False:
                        self._start_call(out, head[1])
                        self._keyed = KeyedArguments(self, head[1])
                        self._state, i = "params", head[0]
                        continue
                else:
                    end = at(buf, i, END)
                    if end is None:
                        return i
                    if end is not False:
                        self._in_block = False
                        return end
                if not self.block_has_calls():
                    raise Malformed("expected an invoke tag")
                self._in_block = False            # stray text after the calls: the block ends
                return i
            # state == "params": parameters of an open call, or its end tag
            end = at(buf, i, PARAM)
            if end is None:
                return i
            if end is not False:
                head = self._head(buf, end, _PARAM_HEAD)
                if head is None:
                    return i
                if head is False:                 # a broken parameter tag: skip past it
                    i = end
                    continue
                self._keyed.begin(out, head[1], None if head[2] is None else head[2] == "true")
                self._state, i = "value", head[0]
                continue
            end = at(buf, i, INVOKE_END)
            if end is None:
                return i
            if end is False:
                i += 1                            # text between parameters: not part of the call
                continue
            self._keyed.close(out)
            self._end_call()
            self._state, self._keyed, i = "between", None, end

    def _head(self, buf: str, i: int, pattern: re.Pattern):
        """``(end, *groups)`` of a tag's attributes at ``buf[i:]``; None: wait for more (the ``>``
        has not come); False: not a tag of this shape."""
        close = buf.find(">", i, i + _HEAD_LIMIT)
        if close == -1:
            return None if len(buf) - i < _HEAD_LIMIT else False
        match = pattern.match(buf, i, close + 1)
        return False if match is None else (match.end(), *match.groups())
