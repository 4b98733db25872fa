"""Chat prompts over gRPC: ``pb.Chat`` (history with tool calls and results, tools, template
variables) checked as the OpenAI API checks them (:mod:`cluster.frontend.chat_request`) and
rendered by the model's template; with ``OutputParsing``, the answer read by the same parser chain
as the HTTP API's (:mod:`cluster.frontend.chat_output`), its deltas put beside the raw text.
"""

from __future__ import annotations

import json

from shardserve.cluster.engine.request import SamplingParams
from shardserve.cluster.frontend.chat_output import ChoiceOutput, ParserConfig
from shardserve.cluster.frontend.chat_request import chat_messages, parse_chat_options, tool_constraint
from shardserve.cluster.frontend.openai_protocol import OpenAIError
from shardserve.cluster.tokenizer import encode_rendered, render_chat
from shardserve.proto import inference_pb2 as pb

_NO_PARAMETERS = '{"type": "object", "properties": {}}'


def chat_chars(msg: pb.Chat) -> int:
    """Characters of a proto chat's text (messages, calls, tools, template variables): what the
    prompt-size limit counts before anything is rendered."""
    size = len(msg.template_kwargs) + sum(len(t.name) + len(t.description) + len(t.parameters) for t in msg.tools)
    for m in msg.messages:
        size += len(m.content) + len(m.reasoning_content) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
    return size


def _messages(msg: pb.Chat) -> list[dict]:
    messages = []
    for m in msg.messages:
        entry = {"role": m.role, "content": m.content}
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id or None, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key):
                entry[key] = getattr(m, key)
        if m.HasField("reasoning_content"):
            entry["reasoning_content"] = m.reasoning_content
        messages.append(entry)
    return messages


def _body(msg: pb.Chat, parsing: pb.OutputParsing | None) -> dict:
    """The OpenAI chat body equivalent to a proto chat and its parsing options."""
    try:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or None,
                                                   "parameters": json.loads(t.parameters or _NO_PARAMETERS)}}
                 for t in msg.tools]
        kwargs = json.loads(msg.template_kwargs) if msg.template_kwargs else None
    except ValueError as exc:
        raise ValueError(f"chat: a tool's parameters or template_kwargs is not valid JSON: {exc}") from None
    choice = (parsing.tool_choice if parsing is not None else "") or (
        "auto" if parsing is not None and parsing.tool_call_parser else "none")
    if choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"messages": _messages(msg), "tools": tools, "chat_template_kwargs": kwargs, "tool_choice": choice,
            "parallel_tool_calls": not (parsing is not None and parsing.single_tool_call)}


def chat_prompt(tokenizer, msg: pb.Chat, parsing: pb.OutputParsing | None,
                params: SamplingParams | None) -> tuple[list[int], ChoiceOutput | None]:
    """Prompt ids of a proto chat and, with ``parsing``, its output chain; ``params`` gets what the
    chain needs (special tokens kept; the call constraint of ``required`` / a named function).

    Raises:
        ValueError: a malformed message, tool, template variable or parsing option.
    """
    body = _body(msg, parsing)
    try:
        chat = chat_messages(body["messages"])
        options = parse_chat_options(body)
    except OpenAIError as exc:
        raise ValueError(f"{exc.param or 'chat'}: {exc.message}") from None
    text = render_chat(tokenizer, chat, tools=options.tools, template_kwargs=options.template_kwargs)
    ids = encode_rendered(tokenizer, text)
    if parsing is None:
        return ids, None
    parsers = ParserConfig(parsing.tool_call_parser or None, bool(parsing.tool_call_parser),
                           parsing.reasoning_parser or None)
    parsers.validate()
    try:
        parsers.check(options)
    except OpenAIError as exc:
        raise ValueError(f"parsing: {exc.message}") from None
    constraint = tool_constraint(options)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError("parsing: tool_choice required / a function already constrains the output; "
                             "drop sampling.structured_outputs")
        params.structured_outputs = constraint
    output = parsers.output(options, text)
    if output is not None:
        params.skip_special_tokens = not output.needs_special_tokens
        params.structured_outputs = output.constraint(params.structured_outputs, tokenizer)
    return ids, output


def parsed_response(resp: pb.GenerateResponse, output: ChoiceOutput) -> pb.GenerateResponse:
    """``resp`` with its text delta parsed (``reasoning``, ``content``, ``tool_calls``) and, once
    finished, ``finish_reason`` as OpenAI's (``tool_calls`` when calls were made)."""
    delta = output.feed(resp.text) if resp.text else None
    if resp.finish_reason:
        last = output.finish()
        delta = last if delta is None else delta.extend(last)
        resp.finish_reason = output.finish_reason(resp.finish_reason)
    if delta is not None:
        resp.reasoning, resp.content = delta.reasoning, delta.content
        resp.tool_calls.extend(pb.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments)
                               for c in delta.calls)
    return resp
