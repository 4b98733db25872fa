"""The agent parts of a chat request and answer, without a model: tools / tool_choice validation
(400 bodies naming the field), every accepted form of history, the schema a forced call is
constrained by (checked with jsonschema), and the output chain (thinking, then calls from the
answer only) streamed against whole."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from shardserve.cluster.frontend.chat_output import ChoiceDelta, ParserConfig, delta_body
from shardserve.cluster.frontend.chat_request import MAX_TOOLS, chat_messages, tool_constraint
from shardserve.cluster.frontend.openai_protocol import OpenAIError, parse_chat, parse_completion
from shardserve.cluster.frontend.reasoning import get_reasoning_parser
from shardserve.cluster.frontend.tool_parsers import get_tool_parser, parse_text

CHAT = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "$defs": {"Key": {"type": "object", "properties": {"id": {"type": "integer"}},
                                        "required": ["id"], "additionalProperties": False}},
    "properties": {"keys": {"type": "array", "items": {"$ref": "#/$defs/Key"}},
                   "mode": {"enum": ["精确", "fuzzy"]}, "alt": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["keys"], "additionalProperties": False}}}


def bad(body: dict, parse=parse_chat) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse(body)
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"
    return err.value


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("body,param,fragment", [
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools", "at most 2048 tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * (1 << 20),
                                                  "parameters": {"type": "object"}}}]}, "tools", "bytes of JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "parameters is required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "two words", "parameters": {}}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only 'function'"),
    ({"tools": "x"}, "tools", "list"),
    ({"tools": [WEATHER], "tool_choice": named("get_time")}, "tool_choice", "'get_time', which 'tools' does not"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "names no function"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs", "object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set ['tools']"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs", "boolean"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "one of"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_agent_fields_are_400_naming_the_field(body, param, fragment):
    err = bad(dict({"messages": CHAT}, **body))
    assert err.param == param and fragment in err.message, err.message


@pytest.mark.parametrize("messages,fragment", [
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                            "function": {"name": "f", "arguments": "{not json"}}]}], "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
     "JSON object"),
    ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "must be"),
    ([{"role": "tool", "tool_call_id": "c"}], "content is required"),
    ([{"role": "tool", "content": [{"type": "image_url"}]}], "only text parts"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], "tool_call_id must be a string"),
    ([{"role": "assistant", "content": "", "reasoning_content": 3}], "reasoning_content must be a string"),
])
def test_bad_history_is_400_naming_messages(messages, fragment):
    err = bad({"messages": messages})
    assert err.param == "messages" and fragment in err.message, err.message


def test_tools_on_completions_are_refused():
    assert bad({"prompt": "x", "tools": [WEATHER]}, parse_completion).param == "tools"


def test_every_accepted_form_of_history():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "巴黎"}'}}
    history = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "weather?"}]
    for assistant in ({"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "assistant", "tool_calls": [call], "reasoning_content": "need the tool"},
                      {"role": "assistant", "tool_calls": [dict(call, function={"name": "get_weather",
                                                                                 "arguments": {"city": "巴黎"}})],
                       "reasoning": "need the tool"}):
        # text parts join with newlines, vLLM's rule (chat_utils._parse_chat_message_content_parts)
        for tool in ({"role": "tool", "tool_call_id": "call_1", "content": "sun\nny"},
                     {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sun"},
                                                                             {"type": "text", "text": "ny"}]}):
            chat = chat_messages(history + [assistant, tool])
            assert chat[0] == {"role": "system", "content": "be brief"}
            assert chat[2]["content"] == "" and chat[2]["tool_calls"] == [
                {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "巴黎"}}}]
            if "reasoning_content" in assistant or "reasoning" in assistant:
                assert chat[2]["reasoning_content"] == chat[2]["reasoning"] == "need the tool"
            assert chat[3] == {"role": "tool", "content": "sun\nny", "tool_call_id": "call_1"}


def test_tool_choice_defaults_and_forms():
    assert parse_chat({"messages": CHAT}).chat.tool_choice == "none"
    parsed = parse_chat({"messages": CHAT, "tools": [WEATHER]})
    assert (parsed.chat.tool_choice, parsed.structured) == ("auto", None)
    flat = parse_chat({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert (flat.chat.tool_choice, flat.chat.function, flat.structured_param) == ("function", "get_weather", "tools")
    assert json.loads(flat.structured.value) == WEATHER["function"]["parameters"]
    assert parse_chat({"messages": CHAT, "tool_choice": "none"}).structured is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constraint_is_a_valid_schema_that_accepts_calls_and_rejects_others(parallel):
    """Each tool's $defs move to the root: $ref, anyOf, enum with non-ASCII and
    additionalProperties: false keep working inside the array of calls."""
    options = parse_chat({"messages": CHAT, "tools": [WEATHER, LOOKUP], "tool_choice": "required",
                          "parallel_tool_calls": parallel}).chat
    schema = json.loads(tool_constraint(options).value)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "lookup", "parameters": {"keys": [{"id": 1}], "mode": "精确", "alt": None}},
            {"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(good[:1], schema)
    assert jsonschema.Draft202012Validator(schema).is_valid(good) == parallel
    for wrong in ([], [{"name": "lookup", "parameters": {"keys": [{"id": "1"}]}}],
                  [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                  [{"name": "lookup", "parameters": {"keys": [], "extra": 1}}]):
        assert not jsonschema.Draft202012Validator(schema).is_valid(wrong), wrong


def test_auto_tool_choice_needs_the_server_flags():
    options = parse_chat({"messages": CHAT, "tools": [WEATHER]}).chat
    with pytest.raises(OpenAIError) as err:
        ParserConfig().check(options)
    assert err.value.param == "tool_choice" and "--enable-auto-tool-choice" in err.value.message
    ParserConfig("hermes", True).check(options)
    ParserConfig().check(parse_chat({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}).chat)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ParserConfig(enable_auto_tool_choice=True).validate()
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ParserConfig(reasoning_parser="nope").validate()


DSML = "｜DSML｜"
CALL = (f'<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n'
        f'<{DSML}parameter name="city" string="true">杭州</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>')


def chain(reasoning: str | None = "deepseek_v3", tools: str | None = "deepseek_v32", prompt="<｜Assistant｜><think>",
          parallel=True, include_reasoning=True, choice="auto"):
    body = {"messages": CHAT, "tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": parallel,
            "include_reasoning": include_reasoning}
    return ParserConfig(tools, tools is not None, reasoning).output(parse_chat(body).chat, prompt)


def run_stream(output, pieces: list[str], reason: str) -> tuple[dict, str]:
    """What a client assembles from the chunks: the message fields and the finish reason."""
    deltas = [delta_body(output.feed(p)) for p in pieces] + [delta_body(output.finish())]
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for delta in deltas:
        message["content"] += delta.get("content", "")
        assert delta.get("reasoning", "") == delta.get("reasoning_content", "")
        message["reasoning_content"] += delta.get("reasoning_content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] not in message["tool_calls"] and piece["type"] == "function"
                message["tool_calls"][piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"],
                                                         "arguments": ""}
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            message["tool_calls"][piece["index"]]["arguments"] += piece["function"]["arguments"]
    return message, output.finish_reason(reason)


def whole(output, text: str, reason: str) -> tuple[dict, str]:
    output.feed(text)
    output.finish()
    return output.message(), output.finish_reason(reason)


def test_calls_count_only_after_thinking_and_stream_equals_whole():
    text = f"I could write {CALL} here, but thinking does not call.</think>\n\nLet me look it up.\n\n{CALL}"
    message, reason = whole(chain(), text, "stop")
    assert reason == "tool_calls"
    assert message["reasoning_content"] == message["reasoning"] == f"I could write {CALL} here, but thinking does not call."
    assert message["content"] == "Let me look it up."
    (call,) = message["tool_calls"]
    assert (call["type"], call["function"]["name"], json.loads(call["function"]["arguments"])) == \
        ("function", "get_weather", {"city": "杭州"})
    rng = random.Random(0)
    for trial in range(40):
        cuts = sorted(rng.sample(range(len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        streamed, streamed_reason = run_stream(chain(), pieces, "stop")
        assert streamed_reason == reason
        assert streamed["content"] == message["content"]
        assert streamed["reasoning_content"] == message["reasoning_content"]
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_finish_reasons_thinking_off_and_limits():
    cut_in_thinking = whole(chain(), "still thinking about", "length")
    assert cut_in_thinking == ({"role": "assistant", "content": "", "reasoning_content": "still thinking about",
                                "reasoning": "still thinking about"}, "length")
    message, reason = whole(chain(), f"ok</think>{CALL[:-30]}", "length")     # cut inside the call
    assert reason == "length" and message["content"] is None and len(message["tool_calls"]) == 1
    off = whole(chain(prompt="<｜Assistant｜></think>"), f"No thinking.\n\n{CALL}", "stop")
    assert off[0]["reasoning_content"] is None and off[0]["content"] == "No thinking." and off[1] == "tool_calls"
    plain = whole(chain(reasoning=None), "just text <think>", "stop")
    assert plain == ({"role": "assistant", "content": "just text <think>"}, "stop")
    two = whole(chain(parallel=False, reasoning=None), CALL + CALL, "stop")[0]
    assert len(two["tool_calls"]) == 1
    hidden = whole(chain(include_reasoning=False), "secret</think>shown", "stop")[0]
    assert hidden == {"role": "assistant", "content": "shown"}


def test_tool_choice_none_leaves_markup_shaped_text_alone():
    assert chain(reasoning=None, choice="none") is None      # nothing to parse: the text is the content
    output = chain(choice="none")
    assert whole(output, f"think</think>{CALL}", "stop") == (
        {"role": "assistant", "content": CALL, "reasoning_content": "think", "reasoning": "think"}, "stop")


def test_choice_delta_extend_joins_fragments_of_one_call():
    output = ParserConfig("hermes", True).output(parse_chat({"messages": CHAT, "tools": [WEATHER]}).chat, "")
    first = output.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    first.extend(output.feed('ty": "Rome"}}</tool_call>'))
    first.extend(output.finish())
    (piece,) = delta_body(first)["tool_calls"]
    assert piece["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'} and piece["index"] == 0
    assert ChoiceDelta().extend(ChoiceDelta("r", "c")) == ChoiceDelta("r", "c")


def test_parsers_for_every_name_build():
    for name in ("hermes", "deepseek_v32", "glm45", "llama3_json", "deepseek_v3"):
        get_tool_parser(name)({})
    for name in ("deepseek_r1", "qwen3"):
        get_reasoning_parser(name)("", None)


def test_builtin_deepseek_v32_template_and_dsml_parser_agree(tmp_path):
    """Calls in the history, rendered by the built-in DeepSeek-V3.2 template, parse back to the same
    calls with the deepseek_v32 parser (every JSON type, non-ASCII, no parameters)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from shardserve.cluster.tokenizer import builtin_template, render_chat

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
                                        bos_token="<｜begin▁of▁sentence｜>")
    tokenizer.chat_template = builtin_template(tmp_path / "config.json")
    calls = [("get_weather", {"city": "杭州", "days": 3}),
             ("record", {"s": 'a "b"\nc', "f": 2.5, "ok": True, "none": None, "arr": [1, "二"], "obj": {"k": [{}]}}),
             ("ping", {})]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}]
    text = render_chat(tokenizer, chat_messages(history), tools=[WEATHER])
    answer = text.split("<｜Assistant｜></think>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    result = parse_text(get_tool_parser("deepseek_v32")({}), answer)
    assert result.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n") and '"name": "get_weather"' in text


def test_a_forced_call_after_thinking_is_constrained_from_the_end_of_thinking():
    """With a reasoning parser the call's constraint starts after ``</think>`` (its token ids) when
    the answer thinks first, and from the first token when thinking is off; the thinking is
    reasoning, the call after it is parsed."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from shardserve.cluster.frontend.structured import structured_from_proto, structured_to_proto

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    end = tokenizer.convert_tokens_to_ids("</think>")
    spec = tool_constraint(parse_chat({"messages": CHAT, "tools": [WEATHER], "tool_choice": named("get_weather")}).chat)
    thinking = chain(choice=named("get_weather"))
    deferred = thinking.constraint(spec, tokenizer)
    assert deferred.start_after == (end,) and spec.start_after == ()
    assert structured_from_proto(structured_to_proto(deferred)) == deferred   # the gRPC hop
    assert chain(choice=named("get_weather"), prompt="<｜Assistant｜></think>").constraint(spec, tokenizer) == spec
    assert chain(reasoning=None, choice="required").constraint(spec, tokenizer) == spec
    assert thinking.constraint(None, tokenizer) is None
    message, reason = whole(thinking, 'Rome it is.</think>{"city": "Rome"}', "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "Rome it is." and not message["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city": "Rome"}')]
