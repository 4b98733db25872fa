"""From a chat answer's text to OpenAI's message fields: thinking (``reasoning_content`` and
``reasoning``), content and ``tool_calls``, streamed (chunk deltas) or not (the message), through
the parsers the server was started with (``--reasoning-parser``, ``--tool-call-parser``).

One :class:`ChoiceOutput` per choice chains them: the reasoning parser splits the thinking off,
and only the answer part goes to the tool parser (a call written while thinking is not a call).
The non-streamed message is the same chain fed the whole text, so it equals what the chunks add
up to. ``finish_reason`` becomes ``"tool_calls"`` when the answer made calls and ended by itself;
``"length"`` stays (an answer cut inside thinking or inside a call).

An output constraint (a schema, a forced call) of a choice that thinks first applies after its
thinking (:meth:`ChoiceOutput.constraint`): thinking, speculation and the grammar work together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shardserve.cluster.engine.request import StructuredOutputs

from shardserve.cluster.frontend.chat_request import ChatOptions
from shardserve.cluster.frontend.openai_protocol import bad_request
from shardserve.cluster.frontend.reasoning import ReasoningParser, get_reasoning_parser, reasoning_parser_names
from shardserve.cluster.frontend.reasoning.base import END as REASONING_END
from shardserve.cluster.frontend.tool_parsers import CallDelta, ParseDelta, ToolParser, get_tool_parser, tool_parser_names
from shardserve.cluster.frontend.tool_parsers.forced import NamedCallParser, RequiredCallsParser


@dataclass(slots=True)
class ParserConfig:
    """The server's parser settings (vLLM's flags).

    Attributes:
        tool_call_parser: ``--tool-call-parser`` name, or None.
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: the model may decide to call
            (``tool_choice: "auto"``, the default when a request has tools); needs a parser.
        reasoning_parser: ``--reasoning-parser`` name, or None.
    """

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def validate(self) -> None:
        """Raises ValueError: an unknown parser name (listing the known ones), or auto tool choice
        without a parser."""
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                             f"{', '.join(tool_parser_names())})")

    def check(self, options: ChatOptions) -> None:
        """Raises OpenAIError (400): the request lets the model choose to call tools, and this server
        was not started to parse calls (vLLM's rule)."""
        if options.tool_choice == "auto" and options.tools and not self.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice (the default with tools) requires the server to run with '
                              "--enable-auto-tool-choice and --tool-call-parser; send tool_choice \"none\", "
                              '"required" or a named function instead', "tool_choice")

    def output(self, options: ChatOptions | None, prompt: str | None) -> ChoiceOutput | None:
        """The output chain of one choice (None: plain text, nothing to parse).

        Args:
            options: the request's agent settings (None: a request without them).
            prompt: the rendered prompt (tells whether the answer starts inside thinking).
        """
        options = options or ChatOptions()
        tools: ToolParser | None = None
        if options.tool_choice == "function":
            tools = NamedCallParser(options.function, options.schemas)
        elif options.tool_choice == "required":
            tools = RequiredCallsParser(options.schemas)
        elif options.tool_choice == "auto" and options.tools and self.tool_call_parser:
            tools = get_tool_parser(self.tool_call_parser)(options.schemas)
        reasoning = None
        if self.reasoning_parser:
            reasoning = get_reasoning_parser(self.reasoning_parser)(prompt, options.thinking)
        if tools is None and reasoning is None:
            return None
        return ChoiceOutput(reasoning, tools, options.parallel_tool_calls, options.include_reasoning)


@dataclass(slots=True)
class ChoiceDelta:
    """What one piece of text added to a choice."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ChoiceDelta) -> ChoiceDelta:
        """Append ``other`` (a call's argument fragments that follow each other are joined)."""
        self.reasoning += other.reasoning
        merged = ParseDelta(self.content, self.calls).add(ParseDelta(other.content, other.calls))
        self.content, self.calls = merged.content, merged.calls
        return self


class ChoiceOutput:
    """The parser chain of one choice.

    Args:
        reasoning: splits thinking off first (None: no thinking block).
        tools: finds calls in the answer part (None: the answer is content).
        parallel_tool_calls: False = calls after the first are dropped.
        include_reasoning: False = the thinking is dropped from the output.
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True,
                 include_reasoning: bool = True) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.parallel, self.include_reasoning = parallel_tool_calls, include_reasoning
        self.num_calls = 0
        self.text = {"reasoning": [], "content": []}   # everything told, for the finished message
        self.calls: dict[int, dict] = {}

    @property
    def thinks_first(self) -> bool:
        """The answer starts inside (or may open) a thinking block: an output constraint waits for
        its end (:meth:`constraint`)."""
        return self.reasoning is not None and self.reasoning.thinking

    def constraint(self, spec: StructuredOutputs | None, tokenizer) -> StructuredOutputs | None:
        """``spec`` as it applies to this choice: when the answer thinks first, from after the
        thinking block's end (the ids of ``</think>`` in ``tokenizer``), so the model thinks freely
        and the answer part follows the schema (vLLM's structured outputs with a reasoning parser).
        An answer that never closes its thinking stays unconstrained (and ends by ``length``)."""
        if spec is None or not self.thinks_first:
            return spec
        return dataclasses.replace(spec, start_after=tuple(tokenizer.encode(REASONING_END, add_special_tokens=False)))

    @property
    def needs_special_tokens(self) -> bool:
        """Decode special tokens: the markers the parsers look for may be special tokens."""
        return any(p is not None and p.needs_special_tokens for p in (self.reasoning, self.tools))

    def feed(self, text: str) -> ChoiceDelta:
        """The next text delta of the choice."""
        return self._step(text, final=False)

    def finish(self) -> ChoiceDelta:
        """The choice's text has ended."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ChoiceDelta:
        out = ChoiceDelta()
        if self.reasoning is not None:
            split = self.reasoning.finish() if final else self.reasoning.feed(text)
            out.reasoning, answer = split.reasoning, split.content
        else:
            answer = text
        if self.tools is not None:
            parsed = self.tools.feed(answer) if answer else None
            last = self.tools.finish() if final else None
            for part in (parsed, last):
                if part is not None:
                    out.content += part.content
                    out.calls += [c for c in part.calls if self.parallel or c.index == 0]
        else:
            out.content = answer
        if not self.include_reasoning:
            out.reasoning = ""
        self.text["reasoning"].append(out.reasoning)
        self.text["content"].append(out.content)
        for piece in out.calls:
            call = self.calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                                       "function": {"name": piece.name, "arguments": ""}})
            call["function"]["arguments"] += piece.arguments
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when calls were made and the answer ended by itself."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        """The non-streamed ``message`` once the text was fed and finished."""
        content = "".join(self.text["content"])
        message = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        if self.reasoning is not None and self.include_reasoning:
            reasoning = "".join(self.text["reasoning"]) or None
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message


def delta_body(delta: ChoiceDelta) -> dict:
    """A chunk's ``delta`` fields for ``delta`` (empty dict: nothing to tell)."""
    body = {}
    if delta.reasoning:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    if delta.calls:
        body["tool_calls"] = [_call_piece(piece) for piece in delta.calls]
    return body


def _call_piece(piece: CallDelta) -> dict:
    """One ``delta.tool_calls`` entry: index, id, type and name on a call's first piece only."""
    if piece.id is not None:
        return {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}

