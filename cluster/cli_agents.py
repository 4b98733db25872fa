"""The CLI's agent flags: the parsers ``serve`` and ``manifest`` run (vLLM's ``--tool-call-parser``,
``--enable-auto-tool-choice``, ``--reasoning-parser``), and tools and thinking for ``generate
--chat`` (``--tools FILE``, ``--tool-choice``, ``--chat-template-kwargs``), which then prints the
parsed answer as one JSON object: ``{"reasoning", "content", "tool_calls", "finish_reason"}``.

An unknown parser name is a usage error (one line listing the names, exit code 2), found before
anything loads.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from shardserve.cluster.frontend.chat_output import ChoiceOutput, ParserConfig
from shardserve.cluster.frontend.reasoning import reasoning_parser_names
from shardserve.cluster.frontend.tool_parsers import tool_parser_names


def add_parser_flags(parser: argparse.ArgumentParser, auto_choice: bool = True) -> None:
    """``--tool-call-parser``, ``--reasoning-parser`` (and ``--enable-auto-tool-choice``)."""
    parser.add_argument("--tool-call-parser", choices=tool_parser_names(), default=None, metavar="NAME",
                        help="parse tool calls out of chat answers in this model family's format: "
                             f"{', '.join(tool_parser_names())} (default: none)")
    parser.add_argument("--reasoning-parser", choices=reasoning_parser_names(), default=None, metavar="NAME",
                        help="split the thinking block into reasoning_content / reasoning: "
                             f"{', '.join(reasoning_parser_names())} (default: none)")
    if auto_choice:
        parser.add_argument("--enable-auto-tool-choice", action="store_true",
                            help="let the model decide when to call tools (tool_choice 'auto', the default when a "
                                 "request has tools); needs --tool-call-parser")


def parser_settings(ns: argparse.Namespace) -> dict:
    """The :class:`ParserConfig` fields (``ServeArgs`` has the same names)."""
    return {"tool_call_parser": ns.tool_call_parser, "reasoning_parser": ns.reasoning_parser,
            "enable_auto_tool_choice": getattr(ns, "enable_auto_tool_choice", False)}


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """``generate``'s tools and thinking flags (with ``--chat``)."""
    add_parser_flags(parser, auto_choice=False)
    parser.add_argument("--tools", default=None, metavar="FILE",
                        help="JSON file with a list of OpenAI function tools, rendered by the chat template "
                             "(needs --chat; default: none)")
    parser.add_argument("--tool-choice", default=None, metavar="CHOICE",
                        help="auto (needs --tool-call-parser), none, required, or a function name (default: auto "
                             "with --tool-call-parser, else none)")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                        help='extra chat-template variables, e.g. \'{"thinking": true}\' (needs --chat; default: none)')


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(slots=True)
class AgentChat:
    """A ``generate --chat`` prompt with tools or parsers: what to send and how to read the answer."""

    parsed: object              # the equivalent chat request (openai_protocol.ParsedRequest), checked
    parsers: ParserConfig

    def encode(self, tokenizer, params) -> tuple[list[int], ChoiceOutput | None]:
        """``(prompt ids, output chain)`` with ``tokenizer``; ``params`` (SamplingParams) gets what
        the chain needs: special tokens kept, the call constraint of ``required`` / a function.

        Raises:
            ValueError: a forced call beside another output constraint, or a chat the template
                refuses.
        """
        from shardserve.cluster.frontend.chat_request import tool_constraint
        from shardserve.cluster.tokenizer import encode_rendered, render_chat

        options = self.parsed.chat
        text = render_chat(tokenizer, self.parsed.prompts[0], tools=options.tools,
                           template_kwargs=options.template_kwargs)
        constraint = tool_constraint(options)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ValueError(f"--tool-choice {options.tool_choice} constrains the output to a call; drop the "
                                 "other output constraint (--json-schema, --regex, ...)")
            params.structured_outputs = constraint
        output = self.parsers.output(options, text)
        params.skip_special_tokens = output is None or not output.needs_special_tokens
        if output is not None:
            params.structured_outputs = output.constraint(params.structured_outputs, tokenizer)
        return encode_rendered(tokenizer, text), output


def agent_chat(ns: argparse.Namespace) -> AgentChat | None:
    """The agent part of ``generate``'s flags (None: a plain prompt), checked before anything loads.

    Raises:
        ValueError: agent flags without ``--chat``, a tools file that cannot be read, or a bad
            tool, tool choice or template argument (the message says which).
    """
    wanted = [flag for flag, value in (("--tools", ns.tools), ("--tool-choice", ns.tool_choice),
                                       ("--chat-template-kwargs", ns.chat_template_kwargs),
                                       ("--tool-call-parser", ns.tool_call_parser),
                                       ("--reasoning-parser", ns.reasoning_parser)) if value is not None]
    if not wanted:
        return None
    if not ns.chat:
        raise ValueError(f"{wanted[0]} needs --chat")
    body: dict = {"messages": [{"role": "user", "content": ns.prompt}]}
    if ns.tools:
        try:
            with open(ns.tools, encoding="utf-8") as handle:
                body["tools"] = json.load(handle)
        except OSError as exc:
            raise ValueError(f"--tools {ns.tools}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"--tools {ns.tools}: not JSON ({exc})") from None
    choice = ns.tool_choice or ("auto" if ns.tool_call_parser else "none")
    body["tool_choice"] = choice if choice in ("auto", "none", "required") else \
        {"type": "function", "function": {"name": choice}}
    if ns.chat_template_kwargs:
        body["chat_template_kwargs"] = ns.chat_template_kwargs
    from shardserve.cluster.frontend.openai_protocol import OpenAIError, parse_chat

    parsers = ParserConfig(ns.tool_call_parser, ns.tool_call_parser is not None, ns.reasoning_parser)
    try:
        parsed = parse_chat(body)
        parsers.check(parsed.chat)
    except OpenAIError as exc:
        raise ValueError(f"{exc.param or 'chat'}: {exc.message}") from None
    return AgentChat(parsed, parsers)


def answer_json(text: str, output: ChoiceOutput | None, finish_reason: str | None) -> str:
    """The answer as one JSON line: ``reasoning``, ``content``, ``tool_calls``, ``finish_reason``."""
    if output is None:
        return json.dumps({"content": text, "finish_reason": finish_reason}, ensure_ascii=False)
    output.feed(text)
    output.finish()
    message = output.message()
    return json.dumps({"reasoning": message.get("reasoning_content"), "content": message["content"],
                       "tool_calls": message.get("tool_calls", []),
                       "finish_reason": output.finish_reason(finish_reason)}, ensure_ascii=False)
