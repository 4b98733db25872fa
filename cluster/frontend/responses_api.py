"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, stateless.

A request becomes a chat request (:func:`parse_responses`): ``instructions`` and ``input``
(a string, or items: messages, ``function_call``, ``function_call_output`` and ``reasoning``
items) become the history, function ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
``max_output_tokens``, ``reasoning.effort`` and ``text.format`` map to their chat equivalents, so
every chat rule (validation, templates, parsers, constrained calls) applies unchanged.

Nothing is stored (``store: false`` behaviour, whatever the request says): a
``previous_response_id`` or ``conversation`` answers 400 (send the whole conversation in
``input``); ``background`` answers 400.

The answer's thinking, text and calls become output items in the order they appear
(``reasoning``, ``message``, ``function_call``): :class:`ResponseBuilder` turns the output chain's
deltas into the Responses event stream (``response.created`` ... ``response.completed``, each event
with a ``sequence_number``), and the non-streamed body is the same builder's final response, so
both agree. An answer cut by ``max_output_tokens`` is ``status: "incomplete"``.
Source: OpenAI's API reference for Responses and its streaming events; the ``openai`` client's
``types/responses`` models.
"""

from __future__ import annotations

import json
import time
import uuid

from shardserve.cluster.frontend.openai_protocol import OpenAIError, ParsedRequest, bad_request, parse_chat

# Request fields read or echoed here; other fields pass to the chat parser (vLLM's extras such as
# top_k, min_p, seed, ...), which refuses what it does not know how to honour.
_ECHO = ("instructions", "metadata", "user", "truncation", "service_tier", "include", "prompt_cache_key",
         "safety_identifier", "top_logprobs", "store")
_STATEFUL = {"previous_response_id": "previous_response_id", "conversation": "conversation"}
_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _input_items(body: dict) -> list[dict]:
    """``instructions`` + ``input`` as chat messages."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise bad_request("'input' is a required property", "input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    thinking = None   # a reasoning item goes with the assistant turn that follows it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}].role must be user, assistant, system or developer, got {role!r}",
                                  "input")
            entry = {"role": role, "content": item.get("content")}
            if role == "assistant" and thinking is not None:
                entry["reasoning_content"], thinking = thinking, None
            messages.append(entry)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":   # calls of one turn join one assistant message
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if thinking is not None:
                last["reasoning_content"], thinking = thinking, None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif kind == "reasoning":
            parts = []
            for name in ("content", "summary"):
                value = item.get(name)
                if value is not None and not isinstance(value, list):
                    raise bad_request(f"input[{i}].{name} must be a list of text parts", "input")
                parts += value or []
            texts = [part.get("text") if isinstance(part, dict) else None for part in parts]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request(f"input[{i}]: a reasoning item's content is text parts", "input")
            thinking = "\n".join(texts)
        elif kind == "item_reference":
            raise bad_request(f"input[{i}]: item references need a response store; this server keeps none "
                              "(send the items themselves)", "input")
        else:
            raise bad_request(f"input[{i}].type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", "input")
    return messages


def _text_format(body: dict) -> dict | None:
    """``text.format`` -> chat ``response_format``."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def _list(body: dict, name: str) -> list:
    value = body.get(name)
    if value is not None and not isinstance(value, list):
        raise bad_request(f"'{name}' must be a list", name)
    return value or []


def parse_responses(body) -> tuple[ParsedRequest, dict]:
    """A ``/v1/responses`` body as a chat request, and the fields the response echoes.

    Raises:
        OpenAIError: 400 naming the first bad field (in the Responses API's names).
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, param in _STATEFUL.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' needs stored responses, and this server stores none (store: false): "
                              "send the whole conversation in 'input'", param)
    if body.get("background"):
        raise bad_request("'background' responses need a response store, which this server has not", "background")
    if body.get("n") not in (None, 1):
        raise bad_request("'n' is not a Responses parameter: a response has one answer (send one request "
                          "per answer)", "n")
    if body.get("top_logprobs") not in (None, 0) or "message.output_text.logprobs" in _list(body, "include"):
        raise bad_request("output logprobs are not supported on /v1/responses (use /v1/chat/completions "
                          "with logprobs)", "top_logprobs" if body.get("top_logprobs") else "include")
    for i, tool in enumerate(_list(body, "tools")):
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}].type {tool.get('type')!r} is not supported (only 'function')", "tools")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad_request(f"'truncation' must be 'auto' or 'disabled', got {body['truncation']!r}", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad_request("'metadata' must be an object of string keys and string values", "metadata")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    chat = {k: v for k, v in body.items() if k not in _ECHO and k not in ("input", "text", "reasoning",
                                                                          "max_output_tokens", "model")}
    chat["messages"] = _input_items(body)
    chat["model"] = body.get("model")
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = _text_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    chat.pop("stream", None)
    try:
        parsed = parse_chat(chat)
    except OpenAIError as err:
        raise OpenAIError(err.status, err.message.replace("'max_tokens'", "'max_output_tokens'")
                          .replace("messages[", "input["), err.type, _RENAMED.get(err.param, err.param),
                          err.code) from None
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    parsed.stream = stream
    parsed.max_tokens_param = "max_output_tokens"   # what the engine's context-length error names
    echo = {"instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or
            ("auto" if body.get("tools") else "none"), "parallel_tool_calls": parsed.chat.parallel_tool_calls,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
            "text": {"format": body.get("text", {}).get("format") or {"type": "text"}} if isinstance(
                body.get("text"), dict) else {"format": {"type": "text"}},
            "user": body.get("user")}
    return parsed, echo


class ResponseBuilder:
    """Turns one answer's deltas (:class:`cluster.frontend.chat_output.ChoiceDelta`) into output
    items and the Responses event stream.

    Args:
        echo: the request fields the response repeats (from :func:`parse_responses`).
        model: the served model name.
        created_at: seconds since the epoch.
    """

    def __init__(self, echo: dict, model: str, created_at: int) -> None:
        self.echo, self.model, self.created_at = echo, model, created_at
        self.id = _new_id("resp")
        self.output: list[dict] = []
        self._open: dict | None = None      # the item being written
        self._open_key = None               # ("reasoning",) / ("message",) / ("call", index)
        self._seq = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        """The response object (``status``: in_progress, completed or incomplete)."""
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "model": self.model, "output": [dict(item) for item in self.output], "store": False,
                "previous_response_id": None, "truncation": "disabled", "usage": usage,
                **{k: v for k, v in self.echo.items()}}
        if status != "in_progress":
            body["completed_at"] = int(time.time())
        return body

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def add(self, delta) -> list[dict]:
        """Events for one delta (items open and close as the kind of text changes)."""
        events = []
        if delta.reasoning:
            events += self._write(("reasoning",), delta.reasoning)
        if delta.content:
            events += self._write(("message",), delta.content)
        for piece in delta.calls:
            if piece.id is not None:
                events += self._close()
                events += self._open_call(piece)
            events += self._write(("call", piece.index), piece.arguments)
        return events

    def finish(self, status: str, usage: dict, incomplete: str | None = None) -> list[dict]:
        """Close the open item; ``response.completed`` (or ``response.incomplete``)."""
        events = self._close(status="incomplete" if incomplete else "completed")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self.response(status, usage, incomplete))]

    # -- items ---------------------------------------------------------------------------------
    def _write(self, key: tuple, text: str) -> list[dict]:
        events = []
        if self._open_key != key:
            events += self._close()
            events += self._open_text(key)
        item, index = self._open, len(self.output) - 1
        if key[0] == "call":
            if text:
                item["arguments"] += text
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=text))
            return events
        part = item["content"][0]
        part["text"] += text
        kind = "response.reasoning_text.delta" if key[0] == "reasoning" else "response.output_text.delta"
        extra = {} if key[0] == "reasoning" else {"logprobs": []}
        events.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra))
        return events

    def _open_text(self, key: tuple) -> list[dict]:
        if key[0] == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.output.append(item)
        self._open, self._open_key = item, key
        index, shown = len(self.output) - 1, dict(item, content=[])
        return [self._event("response.output_item.added", output_index=index, item=shown),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(item["content"][0]))]

    def _open_call(self, piece) -> list[dict]:
        item = {"id": _new_id("fc"), "type": "function_call", "call_id": piece.id, "name": piece.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        self._open, self._open_key = item, ("call", piece.index)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self, status: str = "completed") -> list[dict]:
        item, key = self._open, self._open_key
        if item is None:
            return []
        self._open = self._open_key = None
        index, events = len(self.output) - 1, []
        item["status"] = status
        if key[0] == "call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if key[0] == "reasoning":
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"]))
            else:
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))
        return events


def responses_usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int, cached_tokens: int = 0) -> dict:
    """The Responses API's ``usage`` (all counts in tokens; ``cached_tokens``: prompt tokens read from
    the prefix cache)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}
