"""``deepseek_v3`` (DeepSeek-V3, V3-0324, R1-0528) and ``deepseek_v31`` (V3.1, V3.1-Terminus,
V3.2-Exp) calls::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence: ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
"Paris"}<｜tool▁call▁end｜>``. One parser reads both (the text after ``<｜tool▁sep｜>`` tells which:
JSON starts V3.1's arguments, a name starts V3's). Arguments stream as the model writes them.
Format: the ``tokenizer_config.json`` chat templates of deepseek-ai/DeepSeek-V3-0324 and
DeepSeek-V3.1.
"""

from __future__ import annotations

from shardserve.cluster.frontend.tool_parsers.base import WHITESPACE, Malformed, ParseDelta, at, partial_marker, skip_ws
from shardserve.cluster.frontend.tool_parsers.markup import MarkupParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_LIMIT = 256            # characters a type or name may take
_FENCE_TAIL = WHITESPACE + "`"


class DeepSeekV3ToolParser(MarkupParser):
    """``<｜tool▁calls▁begin｜>`` blocks of V3 or V3.1 calls."""

    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN,)

    def _enter_block(self, marker: str) -> None:
        self._state, self._head, self._held = "between", "", ""

    def _block(self, out: ParseDelta) -> int:
        buf, i = self._buf, 0
        while True:
            state = self._state
            if state == "args":
                end = buf.find(CALL_END, i)
                stop = end if end != -1 else len(buf) - partial_marker(buf[i:], (CALL_END,))
                self._stream_args(out, buf[i:stop], done=end != -1)
                if end == -1:
                    return stop
                self._end_call()
                self._state, i = "between", end + len(CALL_END)
                continue
            if state in ("head", "name"):
                ends = (SEP,) if state == "head" else ("\n",)
                end = buf.find(ends[0], i)
                if end == -1:
                    if len(buf) - i + len(self._head) > _LIMIT:
                        self._broken("no separator")
                        return len(buf)
                    keep = partial_marker(buf[i:], ends)
                    self._head += buf[i:len(buf) - keep]
                    return len(buf) - keep
                self._head += buf[i:end]
                i = end + len(ends[0])
                if state == "head":
                    if not _is_name(self._head.strip()):
                        self._broken("not a type or name before the separator")
                        return i
                    self._state = "after_sep"
                elif self._announce(out, self._head.strip()):
                    self._state = "fence"
                continue
            if state == "after_sep":
                if i == len(buf):
                    return i
                if buf[i] in "{[":               # V3.1: the arguments follow the name
                    if self._announce(out, self._head.strip()):
                        self._state = "args"
                else:                            # V3: the type came first; the name follows
                    self._head, self._state = "", "name"
                continue
            i = skip_ws(buf, i)
            if i == len(buf):
                return i
            if state == "fence":                 # V3: ```json before the arguments
                end = at(buf, i, "```")
                if end is None:
                    return i
                if end is not False:
                    label = buf[end:end + 4]
                    if len(label) < 4 and "json".startswith(label) and not self._final:
                        return i
                    i = end + (4 if label == "json" else 0)
                self._state = "args_ws"
                continue
            if state == "args_ws":
                self._state = "args"
                continue
            # state == "between": the next call, or the end of the block
            end = at(buf, i, CALL_BEGIN)
            if end is None:
                return i
            if end is not False:
                self._state, self._head, i = "head", "", end
                continue
            end = at(buf, i, CALLS_END)
            if end is None:
                return i
            if end is False and not self.block_has_calls():
                raise Malformed("expected a call")
            self._in_block = False
            return i if end is False else end

    def _announce(self, out: ParseDelta, name: str) -> bool:
        if not _is_name(name):
            self._broken("not a function name")
            return False
        self._start_call(out, name)
        self._held = ""
        return True

    def _broken(self, why: str) -> None:
        if not self.block_has_calls():
            raise Malformed(why)
        self._state = "between"

    def _stream_args(self, out: ParseDelta, piece: str, done: bool) -> None:
        """Arguments text; trailing whitespace and backticks wait (they may be V3's closing fence)."""
        text = self._held + piece
        body = text.rstrip(_FENCE_TAIL)
        self._held = text[len(body):]
        if done:
            self._held = ""
        self._args(out, body)


def _is_name(text: str) -> bool:
    return bool(text) and not any(c in text for c in '{}<>"\n')


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """The same parser under vLLM's V3.1 name."""

    name = "deepseek_v31"
