"""Incremental reading of a call written as JSON: ``{"name": "f", "arguments": {...}}`` (Hermes /
Qwen, Llama 3 with ``"parameters"``, the array a ``tool_choice: "required"`` request generates).

The text arrives in pieces. :class:`JsonCall` tells the name as soon as its string is complete and
keeps the arguments value's raw text as it grows, so a parser can stream argument fragments that
concatenate to exactly the JSON the model wrote. Key order does not matter (arguments before the
name are kept until the name is known). Only structure is checked here (strings, escapes, matching
brackets, bare words): enough to find where a value ends and to refuse what is not JSON at all.
"""

from __future__ import annotations

import json

from shardserve.cluster.frontend.tool_parsers.base import WHITESPACE, Malformed

ARGUMENT_KEYS = ("arguments", "parameters")
_CLOSE = {"{": "}", "[": "]"}
_BARE = set("0123456789+-.eEtruefalsn")   # numbers, true, false, null


class JsonValue:
    """Finds where one JSON value ends in text fed piece by piece."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_string = False
        self.escaped = False
        self.bare = False          # inside a number or literal
        self.started = False
        self.done = False

    def feed(self, buf: str, i: int, final: bool) -> int:
        """Consume ``buf`` from ``i``; returns where it stopped (at the value's end once
        :attr:`done`; a number or literal ends at the delimiter after it, not consumed).

        Raises:
            Malformed: not JSON; ``args[1]`` is the index of the offending character.
        """
        size = len(buf)
        while i < size:
            char = buf[i]
            if not self.started:
                if char in WHITESPACE:
                    i += 1
                    continue
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if not self.stack:
                        self.done = True
                        return i + 1
                elif char < " ":
                    raise Malformed("a control character inside a JSON string", i)
                i += 1
                continue
            if self.bare:
                if char in _BARE:
                    i += 1
                    continue
                self.bare = False
                if not self.stack:
                    self.done = True
                    return i
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.stack.append(char)
            elif char in "}]":
                if not self.stack or _CLOSE[self.stack[-1]] != char:
                    raise Malformed("unbalanced brackets", i)
                self.stack.pop()
                if not self.stack:
                    self.done = True
                    return i + 1
            elif char in _BARE:
                self.bare = True
            elif not self.stack or char not in WHITESPACE + ",:":
                raise Malformed(f"{char!r} in a JSON value", i)
            i += 1
        if final and self.bare and not self.stack:
            self.done = True
        return i


class JsonCall:
    """One call object read piece by piece.

    Attributes:
        name: the function name once its string is complete (None before).
        args_raw: raw text of the arguments value so far ("" when there is none yet).
        args_is_string: the arguments were written as a JSON string holding JSON (some models do).
        args_done: the arguments value is complete.
        done: the object is closed.
    """

    def __init__(self) -> None:
        self.state = "start"
        self.key = ""
        self._raw = ""            # the current key's or name's raw JSON text
        self._value: JsonValue | None = None
        self.name: str | None = None
        self.args_raw = ""
        self.args_is_string = False
        self.args_done = False
        self.done = False
        self._escaped = False

    def arguments(self) -> str:
        """The finished arguments JSON (``{}`` when the object had none)."""
        if not self.args_raw:
            return "{}"
        if self.args_is_string:
            try:
                return json.loads(self.args_raw)
            except ValueError:
                return self.args_raw
        return self.args_raw

    def feed(self, buf: str, i: int, final: bool) -> int:
        """Consume ``buf`` from ``i`` up to the end of the object; returns where it stopped (also
        right after the name is complete, so the caller announces the call before reading on:
        where the text was split never changes whether a call was announced).

        Raises:
            Malformed: not a call object (not JSON, no ``{``, a name that is not a string, or an
                object that closed without a name).
        """
        size = len(buf)
        while i < size and not self.done:
            char = buf[i]
            state = self.state
            if state in ("start", "key_or_end", "colon", "value_start", "after_value") and char in WHITESPACE:
                i += 1
            elif state == "start":
                if char != "{":
                    raise Malformed("a call object starts with '{'")
                self.state, i = "key_or_end", i + 1
            elif state == "key_or_end":
                if char == "}":
                    self._close()
                    i += 1
                elif char == '"':
                    self.state, self._raw, self._escaped, i = "key", '"', False, i + 1
                else:
                    raise Malformed("a JSON key is a string")
            elif state == "key":
                i = self._read_key(buf, i)
            elif state == "colon":
                if char != ":":
                    raise Malformed("':' after a key")
                self.state, i = "value_start", i + 1
            elif state == "value_start":
                self._value, self._raw = JsonValue(), ""
                if self.key in ARGUMENT_KEYS:
                    self.args_raw, self.args_is_string = "", char == '"'
                self.state = "value"
            elif state == "value":
                try:
                    end = self._value.feed(buf, i, final)
                except Malformed as exc:   # keep the arguments up to the fault: whole = split
                    if self.key in ARGUMENT_KEYS:
                        self.args_raw += buf[i:exc.args[1]]
                    raise
                piece = buf[i:end]
                if self.key in ARGUMENT_KEYS:
                    self.args_raw += piece
                elif self.key == "name":
                    self._raw += piece
                i = end
                if self._value.done:
                    self._value_done()
                    if self.key == "name":
                        return i
            elif state == "after_value":
                if char == ",":
                    self.state = "key_or_end"
                elif char == "}":
                    self._close()
                else:
                    raise Malformed("',' or '}' after a value")
                i += 1
        if final and self.state == "value" and self._value is not None and self._value.done:
            self._value_done()
        return i

    def _read_key(self, buf: str, i: int) -> int:
        size = len(buf)
        start = i
        while i < size:
            char = buf[i]
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._raw += buf[start:i + 1]
                try:
                    self.key = json.loads(self._raw)
                except ValueError as exc:
                    raise Malformed("a bad JSON key") from exc
                self.state = "colon"
                return i + 1
            i += 1
        self._raw += buf[start:i]
        return i

    def _value_done(self) -> None:
        if self.key == "name":
            try:
                name = json.loads(self._raw)
            except ValueError as exc:
                raise Malformed("a bad name") from exc
            if not isinstance(name, str) or not name.strip():
                raise Malformed("the name of a call is a non-empty string")
            self.name = name.strip()
        elif self.key in ARGUMENT_KEYS:
            self.args_done = True
        self.state = "after_value"

    def _close(self) -> None:
        if self.name is None:
            raise Malformed("a call object without a name")
        self.done = True
