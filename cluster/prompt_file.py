"""``generate --prompt-file FILE`` (``-`` = standard input): prompts too long for one argv.

The file is read as UTF-8 and used verbatim except for one trailing line break, which editors and
``echo`` add (llama.cpp's ``--file`` drops it the same way). Errors are one line (``ValueError``:
the CLI prints it and exits 2) and are found before the model loads.
"""

from __future__ import annotations

import sys


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from ``--prompt`` or ``--prompt-file`` (exactly one of them is set).

    Raises:
        ValueError: the file cannot be read, is not UTF-8, or the prompt is empty.
    """
    if prompt_file is None:
        if not prompt:
            raise ValueError("--prompt must not be empty")
        return prompt
    where = "standard input" if prompt_file == "-" else prompt_file
    try:
        if prompt_file == "-":
            text = sys.stdin.buffer.read().decode("utf-8")
        else:
            with open(prompt_file, "rb") as handle:
                text = handle.read().decode("utf-8")
    except OSError as exc:
        raise ValueError(f"--prompt-file {prompt_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompt-file: {where} is not UTF-8 text (byte {exc.start})") from None
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise ValueError(f"--prompt-file: {where} holds no prompt (empty)")
    return text
