"""The machinery of the markup families (DSML, DeepSeek V3, GLM, Hermes): the plain-text state that
finds where a call block starts (outside markdown code, markers split across deltas held back,
whitespace next to blocks dropped), the block loop that turns a malformed block back into content,
and the arguments builder of the formats that write parameters one by one as text (DSML, GLM),
typed by the tool's schema. The rules are those of :mod:`.base`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shardserve.cluster.frontend.tool_parsers.base import (
    WHITESPACE, BufferedParser, Malformed, ParseDelta, ToolParser, new_call_id)


def schema_types(schema: dict | None) -> set[str]:
    """The JSON types a parameter's schema allows (``type``, ``anyOf``/``oneOf`` members, ``enum``
    values); empty = unknown (any)."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            member_types = schema_types(member)
            if not member_types:
                return set()
            types |= member_types
    for value in schema.get("enum") or []:
        types.add("string" if isinstance(value, str) else "other")
    if "const" in schema:
        types.add("string" if isinstance(schema["const"], str) else "other")
    return types


def param_types(tools: dict[str, dict], function: str | None, parameter: str) -> set[str]:
    """JSON types the tool schema allows for ``parameter`` of ``function`` (empty: unknown)."""
    schema = tools.get(function or "") or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return schema_types(properties.get(parameter)) if isinstance(properties, dict) else set()


def typed_value(raw: str, types: set[str]) -> object:
    """A parameter written as plain text (DSML ``string="false"``, GLM ``<arg_value>``) as a JSON
    value: JSON when it parses as one the schema allows, else the text as a string."""
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return raw
    if types and "string" in types and not isinstance(value, (dict, list)) and _json_type(value) not in types:
        return raw   # e.g. "007" for a string parameter stays "007"
    return value


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "other"


class PlainText:
    """The plain-text state of a markup parser: finds the first start marker outside markdown
    code, holds back text that could still become a marker or a longer backtick run, and drops
    whitespace next to call blocks.

    Code spans: a run of three or more backticks opens or closes a fence; a run of one or two
    opens or closes an inline span, which a newline also closes.

    Args:
        markers: the strings that open a call block.
    """

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self._firsts = {m[0] for m in markers}
        self._longest = max((len(m) for m in markers), default=0)
        self.fence = False
        self.inline = False
        self._ws = ""                 # trailing whitespace not told yet
        self._stash = ""              # whitespace before a block that may still turn out content
        self._after_block = False     # a call block just ended: its following whitespace goes

    def scan(self, buf: str, final: bool) -> tuple[int, str | None]:
        """``(end, marker)``: ``buf[:end]`` is plain text (code state updated past it); ``marker``
        starts at ``end`` when one was found. Without a marker, ``buf[end:]`` is held back."""
        i, size = 0, len(buf)
        while i < size:
            char = buf[i]
            if char == "`":
                j = i
                while j < size and buf[j] == "`":
                    j += 1
                if j == size and not final:
                    return i, None          # the run may grow
                if j - i >= 3:
                    self.fence = not self.fence
                    self.inline = False
                elif not self.fence:
                    self.inline = not self.inline
                i = j
                continue
            if char == "\n":
                self.inline = False
            elif char in self._firsts and not self.fence and not self.inline:
                for marker in self.markers:
                    if buf.startswith(marker, i):
                        return i, marker
                if not final and size - i < self._longest and any(marker.startswith(buf[i:]) for marker in self.markers):
                    return i, None
            i += 1
        return size, None

    def text(self, piece: str) -> str:
        """Plain text to tell, whitespace rule applied (trailing whitespace is held)."""
        body = piece.rstrip(WHITESPACE)
        if not body:
            if not self._after_block:
                self._ws += piece
            return ""
        tail = piece[len(body):]
        if self._after_block:
            out, self._after_block = body.lstrip(WHITESPACE), False
        else:
            out = self._ws + body
        self._ws = tail
        return out

    def block_starts(self) -> None:
        self._stash, self._ws = self._ws, ""

    def revert(self) -> None:
        """The block that just started is content after all: its whitespace before comes back."""
        self._ws = self._stash

    def block_ends(self) -> None:
        self._ws, self._after_block = "", True

    def flush(self) -> str:
        """Held whitespace at the end of the text (dropped after a call block)."""
        out, self._ws = ("" if self._after_block else self._ws), ""
        return out


class MarkupParser(BufferedParser):
    """A parser whose calls sit in blocks opened by fixed markers (most families).

    Subclasses set ``start_markers`` and implement :meth:`_block`, which parses from the start of
    the unconsumed text inside a block and returns how much it consumed. Raising
    :class:`Malformed` before a call was announced turns the block, from its marker on, into
    content; returning with ``self._in_block = False`` ends the block.
    """

    start_markers: tuple[str, ...] = ()

    def __init__(self, tools: dict[str, dict] | None = None, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tools, make_id)
        self._plain = PlainText(self.start_markers)
        self._in_block = False
        self._block_raw = ""       # text of the current block consumed before its first call
        self._calls_before = 0     # calls announced before the current block

    def _finish(self, out: ParseDelta) -> None:
        if self._in_block:
            if self._open is not None:
                self._args(out, self._truncated_args())
            elif not self.block_has_calls() and self._block_raw_is_content():
                self._plain.revert()
                out.content += self._plain.text(self._block_raw + self._buf)
            self._buf, self._in_block = "", False
            self._end_call()
        if self._buf:   # held back: a partial marker or backtick run that never completed
            out.content += self._plain.text(self._buf)
        out.content += self._plain.flush()

    def _run(self) -> ParseDelta:
        out = ParseDelta()
        while self._buf:
            if not self._in_block:
                end, marker = self._plain.scan(self._buf, self._final)
                out.content += self._plain.text(self._buf[:end])
                self._buf = self._buf[end:]
                if marker is None:
                    break
                self._plain.block_starts()
                self._buf = self._buf[len(marker):]
                self._in_block, self._block_raw, self._calls_before = True, marker, self.num_calls
                self._enter_block(marker)
                continue
            try:
                consumed = self._block(out)
            except Malformed:
                if self.block_has_calls():
                    raise AssertionError("a parser raised Malformed after announcing a call") from None
                self._buf = self._block_raw[1:] + self._buf
                self._plain.revert()
                out.content += self._plain.text(self._block_raw[0])
                self._in_block = False
                continue
            if not self.block_has_calls():
                self._block_raw += self._buf[:consumed]
            self._buf = self._buf[consumed:]
            if not self._in_block:
                self._plain.block_ends()
                continue
            if consumed == 0:
                break
        return out

    def block_has_calls(self) -> bool:
        """A call was announced since the current block started."""
        return self.num_calls > self._calls_before

    # -- for subclasses ------------------------------------------------------------------------
    def _enter_block(self, marker: str) -> None:
        """A block opened with ``marker`` (reset the per-block state)."""

    def _block(self, out: ParseDelta) -> int:
        """Parse ``self._buf`` inside a block; returns the characters consumed (0: needs more)."""
        raise NotImplementedError

    def _truncated_args(self) -> str:
        """Arguments still to tell when the text ends inside an open call."""
        return ""

    def _block_raw_is_content(self) -> bool:
        """At the end of the text, inside a block with no call yet: True if its text is content
        (it cannot become a call), False if it is an unfinished call (dropped)."""
        return False


def json_string_body(text: str) -> str:
    """``text`` escaped as the inside of a JSON string (non-ASCII kept as is)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class KeyedArguments:
    """Builds a call's arguments JSON from parameters written one by one as plain text (DSML,
    GLM): ``{"key": value, ...}`` with ``json.dumps``' separators. A string value streams as it
    comes (escaped); any other value is held until complete and typed by :func:`typed_value`.

    Args:
        parser: the parser whose open call gets the fragments.
        function: the function's name (its schema gives the parameter types).
    """

    def __init__(self, parser: ToolParser, function: str) -> None:
        self.parser, self.function = parser, function
        self.started = False
        self._key: str | None = None
        self._types: set[str] = set()
        self._stream = False
        self._held = ""

    def begin(self, out: ParseDelta, key: str, written_as_string: bool | None) -> None:
        """A parameter starts; ``written_as_string``: the markup says it is a string (DSML
        ``string="true"``), is not (``"false"``), or does not say (None: the schema decides)."""
        self._key, self._held = key, ""
        self._types = param_types(self.parser.tools, self.function, key)
        if written_as_string is None:
            self._stream = self._types == {"string"}
        else:
            self._stream = written_as_string and (not self._types or "string" in self._types)
        if self._stream:
            self.parser._args(out, self._prefix() + '"')

    def text(self, out: ParseDelta, piece: str) -> None:
        if self._stream:
            self.parser._args(out, json_string_body(piece))
        else:
            self._held += piece

    def end(self, out: ParseDelta) -> None:
        if self._key is None:
            return
        if self._stream:
            self.parser._args(out, '"')
        else:
            value = typed_value(self._held, self._types)
            self.parser._args(out, self._prefix() + json.dumps(value, ensure_ascii=False))
        self._key = None

    def close(self, out: ParseDelta) -> None:
        """The call ends: close the object."""
        self.parser._args(out, "}" if self.started else "{}")

    def _prefix(self) -> str:
        prefix = ", " if self.started else "{"
        self.started = True
        return prefix + json.dumps(self._key, ensure_ascii=False) + ": "
