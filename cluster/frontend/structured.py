"""Structured outputs: the constraint's wire form (proto) and its grammar compile + cache (xgrammar).

A :class:`cluster.engine.request.StructuredOutputs` travels from the OpenAI front (parsed from
``response_format`` / ``structured_outputs``) or a gRPC client to the replica as
``pb.StructuredOutputs`` (:func:`structured_to_proto` / :func:`structured_from_proto`). The replica
compiles it with xgrammar (https://github.com/mlc-ai/xgrammar) against the model's tokenizer:
:class:`GrammarCompiler` runs compiles in its own thread pool, off the engine loop, and keeps
compiled grammars in xgrammar's cache (keyed by the constraint's text and options), so a schema
sent again, or by each of ``n`` choices, compiles once. The per-request matcher that the engine
advances token by token lives in ``cluster/engine/grammar.py``; rank 0 applies its token bitmask
(``workers/logits_processors.py``).

Why xgrammar (not llguidance): it compiles JSON schemas, regexes and EBNF / Lark grammars to
token masks with a persistent per-grammar cache, its matchers roll back any number of tokens
(speculative drafts), and vLLM and SGLang use it as their default backend, so schemas behave
here as they do there (e.g. ``strict_mode``: ``additionalProperties`` defaults to false).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from shardserve.cluster.engine.request import StructuredOutputs
from shardserve.proto import inference_pb2 as pb

CACHE_LIMIT_BYTES = 512 << 20   # compiled grammars kept (xgrammar evicts the least recently used)
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # "[16:33:09] /project/cpp/x.cc:83: " of native errors
_WHAT = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
         "choice": "the choice list", "grammar": "the grammar"}


def structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """Proto constraint -> :class:`StructuredOutputs`.

    Raises:
        ValueError: no kind set, ``json_object`` false, or an empty value (message starts
            ``structured_outputs:``).
    """
    kind = msg.WhichOneof("kind")
    compact = msg.disable_any_whitespace
    try:
        if kind is None or (kind == "json_object" and not msg.json_object):
            raise ValueError("set one of json, json_object (true), regex, choice or grammar")
        if kind == "json":
            spec = StructuredOutputs.json_schema(msg.json, compact)
        elif kind == "json_object":
            spec = StructuredOutputs.json_object(compact)
        elif kind == "choice":
            spec = StructuredOutputs.choice(list(msg.choice.choices))
        else:
            spec = StructuredOutputs(kind, getattr(msg, kind))
        return dataclasses.replace(spec, start_after=tuple(msg.start_after)) if msg.start_after else spec
    except ValueError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def structured_to_proto(spec: StructuredOutputs) -> pb.StructuredOutputs:
    """:class:`StructuredOutputs` -> proto (the router's and clients' side)."""
    msg = pb.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace, start_after=spec.start_after)
    if spec.kind == "json_object":
        msg.json_object = True
    elif spec.kind == "choice":
        msg.choice.choices.extend(spec.value)
    else:
        setattr(msg, spec.kind, spec.value)
    return msg


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals JSON-escaped, which
    xgrammar's EBNF parser reads back: quotes, backslashes, control characters, any Unicode)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _compile_error(spec: StructuredOutputs, exc: Exception) -> ValueError:
    reason = _NATIVE_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
    return ValueError(f"structured_outputs: {_WHAT[spec.kind]} does not compile: {reason}")


def check_syntax(spec: StructuredOutputs) -> None:
    """Parse ``spec`` without a tokenizer (xgrammar's ``Grammar.from_*``), so that a bad constraint
    is refused before a model loads. A Lark grammar is left to :meth:`GrammarCompiler.compile`: it
    may name the tokenizer's special tokens.

    Raises:
        ValueError: as :meth:`GrammarCompiler.compile` would.
    """
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value, any_whitespace=not spec.disable_any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(spec.value))
        elif spec.kind == "grammar" and "::=" in spec.value:
            xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _compile_error(spec, exc) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer, in a thread pool, with a cache.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary (logit columns; may exceed the tokenizer's: padding
            rows are always masked).
        stop_token_ids: the ids that end generation (the engine's EOS set): the only tokens
            allowed once a grammar is complete.
        max_threads: compile threads (the pool's and xgrammar's own).

    The tokenizer's vocabulary is read once, on the first compile (about a second for 50k
    tokens), in the pool as well.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_threads: int = 2) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._compiler = None
        self._pending: dict[StructuredOutputs, Future] = {}   # compiles in flight: one per constraint

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of ``spec`` (blocking; cached).

        Returns:
            ``xgrammar.CompiledGrammar``.

        Raises:
            ValueError: xgrammar cannot compile it; the message starts ``structured_outputs:`` and
                names the problem (e.g. ``Unsupported type "objekt"``).
        """
        compiler = self._xgr_compiler()
        compact = spec.disable_any_whitespace
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.value, any_whitespace=not compact)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact,
                                                    strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.value))
            if "::=" in spec.value:   # EBNF (GBNF); anything else is read as Lark (vLLM's rule)
                return compiler.compile_grammar(spec.value)
            return compiler.compile_lark(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _compile_error(spec, exc) from None

    def submit(self, spec: StructuredOutputs) -> Future:
        """Compile in the pool; concurrent submissions of one constraint share one compile."""
        with self._lock:
            future = self._pending.get(spec)
            if future is None:
                future = self._pool.submit(self.compile, spec)
                self._pending[spec] = future
                future.add_done_callback(lambda _f, key=spec: self._forget(key))
        return future

    def _forget(self, spec: StructuredOutputs) -> None:
        with self._lock:
            self._pending.pop(spec, None)

    async def compile_async(self, spec: StructuredOutputs):
        """:meth:`compile` awaited from an event loop (which keeps running meanwhile)."""
        return await asyncio.wrap_future(self.submit(spec))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
