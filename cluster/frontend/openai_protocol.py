"""OpenAI wire format: request parsing and validation, response and stream-chunk bodies, errors.

Pure functions over JSON-like dicts (no FastAPI, no Ray), so every rule here is unit-testable.
Requests become a :class:`ParsedRequest` (prompts, ``n``, sampling fields in the gRPC
``SamplingParams`` vocabulary); finished or streaming choices become OpenAI bodies
(``chat.completion``, ``chat.completion.chunk``, ``text_completion``). Every problem is an
:class:`OpenAIError` that renders OpenAI's error body with the matching HTTP status.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from shardserve.cluster.engine.request import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                               MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE,
                                               StructuredOutputs)

MAX_N = 16                # choices per request
MAX_TOP_LOGPROBS = MAX_LOGPROBS   # chat ``top_logprobs``; the engine's limit
MAX_COMPLETION_LOGPROBS = 5
# Fields (OpenAI's and vLLM's extensions) whose other values would change the output but this server
# does not implement them -> the values that change nothing (a 400 for any other, never silence).
_UNSUPPORTED = {"functions": (None,), "suffix": (None, ""), "echo": (None, False),
                "include_stop_str_in_output": (None, False), "use_beam_search": (None, False),
                "prompt_logprobs": (None,), "return_tokens_as_token_ids": (None, False),
                "truncate_prompt_tokens": (None,), "chat_template": (None,),
                "add_generation_prompt": (None, True), "continue_final_message": (None, False)}
# Request fields the engine's INVALID_ARGUMENT messages may start with (they name the field first).
_ENGINE_FIELDS = ("max_tokens", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stop", "logprobs", "temperature", "top_p", "top_k",
                  "min_p")


class OpenAIError(Exception):
    """An error with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (400 bad request, 404 unknown model, 503 loading or unavailable).
        message: human-readable reason.
        type_: OpenAI error type (``invalid_request_error``, ``service_unavailable_error``, ...).
        param: the offending request field, if any.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after   # seconds, for a 429's Retry-After (None: the default)

    def body(self) -> dict:
        """The JSON body OpenAI sends for this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable_error", None, "service_unavailable")


def rate_limited(message: str) -> OpenAIError:
    """429: every replica's waiting queue is full (send ``Retry-After`` with it)."""
    return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded")


def limit_error(exc) -> OpenAIError:
    """The OpenAI error of a :class:`cluster.frontend.limits.LimitExceeded`: 413 (body too large),
    429 (rate, with its retry time) or 400."""
    if exc.status == 413:
        return OpenAIError(413, str(exc), "invalid_request_error", None, "request_too_large")
    if exc.status == 429:
        return OpenAIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded", exc.retry_after)
    return bad_request(str(exc), exc.param, "limit_exceeded")


def timed_out(message: str) -> OpenAIError:
    """408: the request passed its deadline (``--request-timeout``) and was aborted."""
    return OpenAIError(408, message, "timeout_error", None, "request_timeout")


def internal_error() -> OpenAIError:
    """500 for an unexpected exception (the details go to the log, not to the client)."""
    return OpenAIError(500, "The server had an error while processing your request.", "server_error", None,
                       "internal_error")


def engine_rejected(message: str, param: str, structured_param: str | None = None,
                    max_tokens_param: str = "max_tokens") -> OpenAIError:
    """A 400 for the engine's INVALID_ARGUMENT (context length gets OpenAI's code; the field named
    is ``max_tokens_param``, the request's own name for it, when that is what does not fit; a
    constraint that does not compile, whose message starts ``structured_outputs:``, names
    ``structured_param``, the field it came from)."""
    if message.startswith("structured_outputs:") and structured_param:
        return bad_request(message, structured_param)
    named = re.match(r"([a-z_]+)\b", message)
    if named and named.group(1) in _ENGINE_FIELDS and "context length" not in message:
        return bad_request(message, named.group(1))
    if "context length" not in message:
        return bad_request(message, param)
    if "max_tokens" in message:
        return bad_request(message.replace("max_tokens", max_tokens_param), max_tokens_param, "context_length_exceeded")
    return bad_request(message, param, "context_length_exceeded")


def load_body(raw: bytes):
    """The JSON value of a request body.

    Raises:
        OpenAIError: 400 when the body is not JSON (broken, not UTF-8, nested too deeply) or holds a
            string that is not valid Unicode (a lone surrogate escape such as ``"\\ud800"``),
            naming the top-level field that holds it.
    """
    try:
        body = json.loads(raw or b"null")
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise bad_request(f"the request body is not valid JSON: {reason}") from exc
    stack = [(body, None)]
    while stack:  # iterative: a deep body must not exhaust the stack here either
        value, top = stack.pop()
        if isinstance(value, str):
            strings = (value,)
        elif isinstance(value, dict):
            strings = tuple(value)
            stack += [(v, top if top is not None else k) for k, v in value.items()]
        elif isinstance(value, list):
            strings = ()
            stack += [(v, top) for v in value]
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                name = top if top is not None and top.isprintable() and _is_unicode(top) else None
                where = f"'{name}'" if name else "the request body"
                raise bad_request(f"{where} holds a string that is not valid Unicode (a lone surrogate "
                                  f"at character {exc.start})", name) from None
    return body


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@dataclass(slots=True)
class ParsedRequest:
    """A validated ``/v1/chat/completions`` or ``/v1/completions`` request."""

    kind: str                                   # "chat" or "completion"
    model: str | None                           # as asked for; None = the served model
    prompts: list                               # chat: [messages]; completion: str or token-id lists
    n: int = 1                                  # choices per prompt
    stream: bool = False
    include_usage: bool = False                 # stream_options.include_usage
    sampling: dict = field(default_factory=dict)  # pb.SamplingParams fields except seed
    seed: int | None = None                     # choice i uses seed + i (vLLM's rule)
    logprobs: int | None = None                 # alternatives per token; None = no logprobs
    max_tokens: int | None = None               # also in ``sampling``; kept for routing cost
    cache_salt: str = ""                        # vLLM's cache_salt: prefix-cache isolation within a key
    # The output constraint (``response_format``, ``structured_outputs``, ``guided_*``; a tool call
    # that must be made sets one too) and the request field it came from, named in errors.
    structured: StructuredOutputs | None = None
    structured_param: str | None = None
    chat: object = None                         # chat: cluster.frontend.chat_request.ChatOptions
    max_tokens_param: str = "max_tokens"        # or max_completion_tokens: the field errors name


MAX_CACHE_SALT_CHARS = 256


def prompt_chars(prompt) -> int:
    """Characters of one parsed prompt (a chat's message contents, earlier thinking and calls' JSON,
    or a text; token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(message.get("content") or "") + len(message.get("reasoning_content") or "") +
                   (len(json.dumps(message["tool_calls"], ensure_ascii=False)) if message.get("tool_calls") else 0)
                   for message in prompt)
    return 0


def _cache_salt(body: dict) -> str:
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                          "cache_salt")
    return salt


def _number(body: dict, name: str, low: float, high: float, *, integer: bool = False,
            low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise bad_request(f"'{name}' must be {kind}, got {value!r}", name)
    # NOTE: JSON integers are unbounded (10**400 cannot become a float): test finiteness on floats only.
    if (isinstance(value, float) and not math.isfinite(value)) or value < low or value > high or \
            (low_open and value == low):
        lo = "(" if low_open else "["
        raise bad_request(f"'{name}' must be in {lo}{_plain(low)}, {_plain(high)}], got {value}", name)
    return value


def _plain(bound: float) -> int | float:
    return int(bound) if float(bound).is_integer() else bound


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise bad_request(f"a stop string holds at most {MAX_STOP_STRING_CHARS} characters", "stop")
    return list(stops)


_JSON_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for json_schema.name
# vLLM's ``structured_outputs`` keys: one constraint, plus options.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_CONSTRAINT_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                       "whitespace_pattern")
# vLLM's older per-kind fields (``extra_body={"guided_json": ...}``), still sent by many clients.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(body: dict) -> StructuredOutputs | None:
    """``response_format``: ``{"type": "text"}`` (OpenAI's default, sent by clients such as
    LangChain) is free output; ``{"type": "json_object"}`` any JSON object;
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` output
    valid against ``schema``."""
    value = body.get("response_format")
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs.json_object()
    if kind != "json_schema":
        raise bad_request(f"'response_format' type {kind!r} is not supported (use 'text', 'json_object' or "
                          "'json_schema')", param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with a 'name' and a 'schema'", param)
    name = spec.get("name")
    if not isinstance(name, str) or not _JSON_SCHEMA_NAME.match(name):
        raise bad_request("'response_format.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, "
                          f"'_' or '-', got {name!r}", param)
    for key, kinds in (("strict", (bool,)), ("description", (str,))):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad_request(f"'response_format.json_schema.{key}' must be a {kinds[0].__name__}", param)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object", param)
    return StructuredOutputs.json_schema(schema)


def _constraint(value, key: str, param: str, compact: bool) -> StructuredOutputs:
    """One constraint of ``structured_outputs`` (or a ``guided_*`` field): ``key`` names its kind."""
    where = f"'{param}.{key}'" if param == "structured_outputs" else f"'{param}'"
    if key == "json":
        if not isinstance(value, (dict, str)):
            raise bad_request(f"{where} must be a JSON schema (an object, or its JSON text)", param)
        try:
            return StructuredOutputs.json_schema(value, compact)
        except ValueError as exc:
            raise bad_request(f"{where}: {exc}", param) from None
    if key == "json_object":
        if value is not True:
            raise bad_request(f"{where} must be true when given", param)
        return StructuredOutputs.json_object(compact)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{where} must be a non-empty list of non-empty strings", param)
        return StructuredOutputs.choice(value)
    if key == "structural_tag":
        raise bad_request(f"{where} is not supported by this server (use json, regex, choice or grammar)", param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", param)
    return StructuredOutputs(key, value)


def _structured_outputs(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """The request's output constraint and the field it came from: OpenAI's ``response_format``,
    vLLM's ``structured_outputs`` object, or vLLM's older ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``; at most one of them."""
    found: list[tuple[StructuredOutputs, str]] = []
    from_format = _response_format(body)
    if from_format is not None:
        found.append((from_format, "response_format"))
    value = body.get("structured_outputs")
    if value is not None:
        param = "structured_outputs"
        if not isinstance(value, dict):
            raise bad_request("'structured_outputs' must be an object", param)
        unknown = sorted(set(value) - set(_CONSTRAINTS) - set(_CONSTRAINT_OPTIONS))
        if unknown:
            raise bad_request(f"unknown 'structured_outputs' field(s) {unknown}", param)
        for option in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            if value.get(option) is not None and not isinstance(value[option], bool):
                raise bad_request(f"'structured_outputs.{option}' must be a boolean", param)
        if value.get("whitespace_pattern") is not None:
            raise bad_request("'structured_outputs.whitespace_pattern' is not supported (use "
                              "disable_any_whitespace)", param)
        given = [key for key in _CONSTRAINTS if value.get(key) is not None]
        if len(given) != 1:
            raise bad_request(f"'structured_outputs' needs exactly one of {list(_CONSTRAINTS[:5])}, got "
                              f"{given or 'none'}", param)
        compact = bool(value.get("disable_any_whitespace"))
        found.append((_constraint(value[given[0]], given[0], param, compact), param))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((_constraint(body[name], key, name, False), name))
    if len(found) > 1:
        names = [param for _, param in found]
        raise bad_request(f"give one output constraint, not {len(found)} ({', '.join(names)})", names[1])
    return found[0] if found else (None, None)


def _common(body: dict, kind: str) -> ParsedRequest:
    for name, no_ops in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value is v or (v == "" and value == "") for v in no_ops):   # 0 is not False here
            raise bad_request(f"'{name}' {json.dumps(value)[:40]} is not supported by this server", name)
    structured, structured_param = _structured_outputs(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})   # OpenAI's fields
    if unknown:
        raise bad_request(f"unknown 'stream_options' field(s) {unknown}", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    n = _number(body, "n", 1, MAX_N, integer=True) or 1
    best_of = _number(body, "best_of", 1, MAX_N, integer=True)
    if best_of not in (None, n):   # best_of == n keeps every choice: the same as no best_of
        raise bad_request(f"'best_of' {best_of} (other than n) is not supported by this server", "best_of")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, max_name, 1, 2**31 - 1, integer=True)
    if max_tokens is None and kind == "completion":
        max_tokens = 16  # OpenAI's default for the legacy endpoint; chat runs to the context limit
    sampling = {"stop": _stop(body)}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    for name, low, high, integer, low_open in (("temperature", 0, MAX_TEMPERATURE, False, False), ("top_p", 0, 1, False, True),
                                               ("top_k", -1, 2**31 - 1, True, False),
                                               ("min_p", 0, 1, False, False)):
        value = _number(body, name, low, high, integer=integer, low_open=low_open)
        if value is not None:
            sampling[name] = value
    sampling.update(_controls(body, max_tokens))
    ignore_eos = body.get("ignore_eos", False)   # vLLM's / llama-server's extension: run to max_tokens
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be a boolean", "ignore_eos")
    if ignore_eos:
        sampling["ignore_eos"] = True
    seed = _number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    return ParsedRequest(kind, model, [], n, stream, bool(options.get("include_usage")), sampling, seed,
                         None, max_tokens, _cache_salt(body), structured, structured_param, max_tokens_param=max_name)


def _controls(body: dict, max_tokens: int | None) -> dict:
    """Penalties (OpenAI's ``presence_penalty`` / ``frequency_penalty``, vLLM's
    ``repetition_penalty``), ``logit_bias`` (token-id strings -> [-100, 100]) and vLLM's
    ``min_tokens``, ``bad_words``, ``allowed_token_ids``, ``stop_token_ids``, ``skip_special_tokens``,
    as ``pb.SamplingParams`` fields."""
    out = {}
    for name, low, high, low_open in (("presence_penalty", -MAX_PENALTY, MAX_PENALTY, False),
                                      ("frequency_penalty", -MAX_PENALTY, MAX_PENALTY, False),
                                      ("repetition_penalty", 0, MAX_REPETITION_PENALTY, True)):
        value = _number(body, name, low, high, low_open=low_open)
        if value is not None:
            out[name] = value
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
        out["logit_bias"] = {}
        for key, value in bias.items():
            if not isinstance(key, str) or not re.fullmatch(r"[0-9]{1,9}", key.strip()):
                raise bad_request(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}",
                                  "logit_bias")
            number = _number({"logit_bias": value}, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            out["logit_bias"][int(key)] = float(number)
    min_tokens = _number(body, "min_tokens", 0, max_tokens if max_tokens is not None else 2**31 - 1, integer=True)
    if min_tokens:
        out["min_tokens"] = min_tokens
    words = body.get("bad_words")
    if words is not None:
        words = [words] if isinstance(words, str) else words
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise bad_request("'bad_words' must be a list of non-empty strings", "bad_words")
        out["bad_words"] = words
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in allowed):
            raise bad_request("'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids")
        out["allowed_token_ids"] = allowed
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in stop_ids):
            raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        out["stop_token_ids"] = stop_ids
    skip = body.get("skip_special_tokens")
    if skip is not None:
        if not isinstance(skip, bool):
            raise bad_request("'skip_special_tokens' must be a boolean", "skip_special_tokens")
        out["skip_special_tokens"] = skip
    return out


def parse_chat(body: dict) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body (messages, tools and the template arguments: see
    :mod:`cluster.frontend.chat_request`).

    Raises:
        OpenAIError: 400 naming the first bad field.
    """
    from shardserve.cluster.frontend.chat_request import chat_messages, parse_chat_options, tool_constraint

    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    chat = chat_messages(body.get("messages"))
    options = parse_chat_options(body)
    parsed = _common(body, "chat")
    parsed.prompts, parsed.chat = [chat], options
    forced = tool_constraint(options)
    if forced is not None:
        if parsed.structured is not None:
            raise bad_request(f"'tool_choice' {options.tool_choice!r} constrains the output to a call; it cannot be "
                              f"combined with '{parsed.structured_param}'", "tool_choice")
        parsed.structured, parsed.structured_param = forced, "tools"
    if not isinstance(body.get("logprobs", False), (bool, type(None))):
        raise bad_request(f"'logprobs' must be a boolean, got {body['logprobs']!r}", "logprobs")
    if body.get("logprobs"):
        parsed.logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True) or 0
    elif body.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return parsed


def parse_completion(body: dict) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (prompt: a string, a list of strings, token ids, or a list
    of token-id lists).

    Raises:
        OpenAIError: 400 naming the first bad field (an empty prompt included).
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("tools") is not None:
        raise bad_request("'tools' needs /v1/chat/completions (or /v1/responses)", "tools")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is a required property", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request("'prompt' must not be empty", "prompt")
    for item in prompts:
        valid = isinstance(item, str) or (isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not valid:
            raise bad_request("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
        if not item:
            raise bad_request("'prompt' must not be empty", "prompt")
    parsed = _common(body, "completion")
    parsed.prompts = prompts
    parsed.logprobs = _number(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, integer=True)
    return parsed


# -- responses ------------------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenText:
    """``token_id -> (text, utf8_bytes)`` for logprobs, cached.

    Byte-level BPE tokens (GPT-2 style, SmolLM2/Llama-3) map to their exact bytes, so a token
    holding half a UTF-8 character reports those bytes and U+FFFD text; SentencePiece byte
    tokens (``<0xE2>``) map to their byte; anything else is the decoded token.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes = _byte_decoder()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
            elif piece and all(c in self._bytes for c in piece):
                raw = bytes(self._bytes[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode("utf-8")
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit


@dataclass(slots=True)
class Choice:
    """One generated choice, accumulated from the replica's stream."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)   # pb.TokenLogprob messages
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0                          # prompt tokens from the prefix cache
    output: object = None          # chat: a cluster.frontend.chat_output.ChoiceOutput (None: plain text)
    spec_decode: object = None       # pb.SpecDecodeUsage of the last response (the replica speculates)
    times: object = None             # pb.RequestTimes of its final response (it stopped or hit a length)
    streamed_chars: int = 0          # streamed: characters of the tokens whose logprobs went out (the next
                                     # text_offset; stop strings hold text back, never a token's logprob)


def usage(prompt_tokens: int, completion_tokens: int, choices: list[Choice] = ()) -> dict:
    """OpenAI's ``usage``; with MTP speculation, plus the extension field ``spec_decode``: the
    choices' ``num_drafts`` (verifying steps), ``num_draft_tokens``, ``num_accepted_tokens`` summed,
    and ``acceptance_length`` (tokens per verifying step: accepted + 1; null before any)."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    specs = [c.spec_decode for c in choices if c.spec_decode is not None]
    if specs:
        counts = {key: sum(getattr(spec, key) for spec in specs)
                  for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        drafts = counts["num_drafts"]
        body["spec_decode"] = dict(counts, acceptance_length=1.0 + counts["num_accepted_tokens"] / drafts
                                   if drafts else None)
    return body


def finish_reason(engine_reason: str) -> str | None:
    """Engine reason -> OpenAI's (``stop``/``length``); None while running."""
    return engine_reason if engine_reason in ("stop", "length") else (None if not engine_reason else "stop")


def chat_logprobs(entries: list, token_text) -> dict:
    """``choices[].logprobs`` of a chat answer from ``pb.TokenLogprob`` entries.

    ``token_text(id)`` returns ``(text, utf8_bytes)`` of one token.
    """
    def one(token_id: int, logprob: float) -> dict:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t.token_id, t.logprob) for t in e.top])
                        for e in entries]}


def completion_logprobs(entries: list, token_text, text_offset: int = 0) -> dict:
    """Legacy ``choices[].logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
    Each ``top_logprobs`` entry holds the top-N alternatives and always the sampled token (OpenAI's
    rule, as vLLM answers: up to N + 1 entries; ``logprobs: 0`` gives the sampled token alone)."""
    tokens, offsets, tops = [], [], []
    for entry in entries:
        text, _ = token_text(entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top = {token_text(t.token_id)[0]: t.logprob for t in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def response_body(kind: str, request_id: str, created: int, model: str, choices: list[Choice],
                  token_text, want_logprobs: bool, n: int) -> dict:
    """Non-streaming body of either endpoint (choice ``index = prompt_index * n + j``); usage sums
    every choice's completion tokens and counts each prompt once, however many choices it has."""
    items = []
    for choice in choices:
        reason = finish_reason(choice.finish_reason or "")
        if kind == "chat":
            lp = chat_logprobs(choice.logprobs, token_text) if want_logprobs else None
            message = {"role": "assistant", "content": choice.text}
            if choice.output is not None:
                choice.output.feed(choice.text)
                choice.output.finish()
                message, reason = choice.output.message(), choice.output.finish_reason(reason)
            items.append({"index": choice.index, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            lp = completion_logprobs(choice.logprobs, token_text) if want_logprobs else None
            items.append({"index": choice.index, "text": choice.text, "logprobs": lp, "finish_reason": reason})
    prompt_tokens = sum({c.index // n: c.prompt_tokens for c in choices}.values())
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": items,
            "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices), choices)}


def chunk_body(kind: str, request_id: str, created: int, model: str, index: int, *, text: str | None = None,
               role: bool = False, logprobs: dict | None = None, finish: str | None = None,
               include_usage: bool = False, fields: dict | None = None) -> dict:
    """One streamed chunk with a single choice (``usage: null`` when usage is reported at the end);
    chat ``fields`` replace ``text`` (a parsed delta: content, reasoning, tool calls)."""
    if kind == "chat":
        delta = {}
        if role:
            delta["role"] = "assistant"
        if fields is not None:
            delta.update(fields)
        elif text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(kind: str, request_id: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int, choices: list[Choice] = ()) -> dict:
    """The last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, choices)}
