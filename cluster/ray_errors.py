"""Readable one-line causes of Ray errors (the CLI's messages, the worker group's failures).

A Ray error's text runs to a dozen lines: the remote traceback of a task error, or an actor
death's class name, actor id, pid and exit detail. Only one line of it says what went wrong.
"""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def root_cause(exc: BaseException) -> str:
    """The message of the last ``SomeError: message`` line of ``exc``'s text (a Ray task error's
    remote traceback ends with the exception the task raised), else its first line, else its
    type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        match = _ERROR_LINE.match(line)
        if match:
            return match.group(2)
    return lines[0] if lines else type(exc).__name__
