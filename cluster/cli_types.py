"""argparse value types shared by every subcommand's flags (a bad value is argparse's one-line
error and exit code 2, naming the flag)."""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A number flag's value: any float but ``inf`` and ``nan`` (which no setting accepts, and
    which overflowed the byte and CPU arithmetic behind the flags).

    Raises:
        argparse.ArgumentTypeError: not a finite number.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def finite_floats(text: str) -> list[float]:
    """Comma-separated finite numbers (``--tensor-split 3,1``).

    Raises:
        argparse.ArgumentTypeError: an entry is not a finite number.
    """
    try:
        return [finite_float(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
