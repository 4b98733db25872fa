"""``shardserve generate``'s structured-output and sampling-control flags (registered by ``cli.py``).

``--json-schema FILE`` (a JSON schema; ``-`` reads stdin), ``--regex``, ``--choice`` (repeatable),
``--grammar FILE`` (EBNF or Lark), ``--json-object``, and the penalties, ``--logit-bias ID=VALUE``,
``--min-tokens``, ``--bad-word`` and ``--allowed-token-id``: the fields of
:class:`cluster.engine.request.SamplingParams` that the HTTP and gRPC APIs take. Everything here
is checked before the model is loaded (a bad flag is one line on stderr, exit code 2); a schema
that does not compile is reported the same way once the tokenizer is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardserve.cluster.cli_types import finite_float
from shardserve.cluster.engine.request import SamplingParams, StructuredOutputs


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags to ``generate``'s parser."""
    group = parser.add_argument_group("structured outputs (at most one)")
    which = group.add_mutually_exclusive_group()
    which.add_argument("--json-schema", metavar="FILE", default=None,
                       help="constrain the output to this JSON schema (a .json file; '-' = stdin) (default: none)")
    which.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    which.add_argument("--regex", default=None, help="the whole output matches this regular expression (default: none)")
    which.add_argument("--choice", action="append", default=None,
                       help="the output is exactly one of these strings; repeatable (default: none)")
    which.add_argument("--grammar", metavar="FILE", default=None,
                       help="constrain the output to this grammar: EBNF (GBNF, start rule 'root') or Lark (default: none)")
    controls = parser.add_argument_group("sampling controls")
    controls.add_argument("--presence-penalty", type=finite_float, default=0.0,
                          help="in [-2, 2]: subtracted from the logit of every token already in the output")
    controls.add_argument("--frequency-penalty", type=finite_float, default=0.0,
                          help="in [-2, 2]: times the token's count in the output, subtracted from its logit")
    controls.add_argument("--repetition-penalty", type=finite_float, default=1.0,
                          help="> 0, 1 = off: logits of tokens in the prompt or output divided (> 0) or multiplied by it")
    controls.add_argument("--logit-bias", action="append", default=None, metavar="ID=VALUE",
                          help="add VALUE in [-100, 100] to token ID's logit; repeatable (default: none)")
    controls.add_argument("--min-tokens", type=int, default=0, help="no EOS, stop token or stop string before this many tokens")
    controls.add_argument("--bad-word", action="append", default=None, metavar="WORD",
                          help="a word never generated; repeatable (default: none)")
    controls.add_argument("--allowed-token-id", action="append", type=int, default=None, metavar="ID",
                          help="only these tokens may be generated; repeatable (default: any)")


def _read(path: str, flag: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc})") from None


def structured_outputs(ns: argparse.Namespace) -> StructuredOutputs | None:
    """The constraint the flags ask for.

    Raises:
        ValueError: an unreadable file, a schema that is not JSON, or an empty value.
    """
    if ns.json_schema is not None:
        text = _read(ns.json_schema, "--json-schema")
        try:
            return StructuredOutputs.json_schema(text)
        except ValueError as exc:
            raise ValueError(f"--json-schema {ns.json_schema}: {exc}") from None
    if ns.json_object:
        return StructuredOutputs.json_object()
    if ns.regex is not None:
        return StructuredOutputs.regex(ns.regex)
    if ns.choice is not None:
        return StructuredOutputs.choice(ns.choice)
    if ns.grammar is not None:
        return StructuredOutputs.grammar(_read(ns.grammar, "--grammar"))
    return None


def _logit_bias(items: list[str] | None) -> dict[int, float] | None:
    if not items:
        return None
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias {item!r}: expected TOKEN_ID=VALUE, e.g. 198=-100") from None
        if not sep:
            raise ValueError(f"--logit-bias {item!r}: expected TOKEN_ID=VALUE, e.g. 198=-100")
    return bias


def apply_flags(ns: argparse.Namespace, params: SamplingParams) -> SamplingParams:
    """Set the constraint and controls on ``params`` (then validated by the caller)."""
    params.structured_outputs = structured_outputs(ns)
    params.presence_penalty, params.frequency_penalty = ns.presence_penalty, ns.frequency_penalty
    params.repetition_penalty, params.min_tokens = ns.repetition_penalty, ns.min_tokens
    params.logit_bias = _logit_bias(ns.logit_bias)
    params.bad_words = list(ns.bad_word or [])
    params.allowed_token_ids = ns.allowed_token_id
    return params
