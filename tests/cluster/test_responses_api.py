"""The Responses API over the chat path, without a model: request items become the chat history
and settings, stateful fields answer 400, and the builder turns an answer's deltas into output
items and the event stream whose final response equals the non-streamed one."""

from __future__ import annotations

import json

import pytest

from shardserve.cluster.frontend.chat_output import ChoiceDelta
from shardserve.cluster.frontend.openai_protocol import OpenAIError
from shardserve.cluster.frontend.responses_api import ResponseBuilder, parse_responses, responses_usage
from shardserve.cluster.frontend.tool_parsers import CallDelta

TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_items_become_the_chat_history_and_settings():
    parsed, echo = parse_responses({
        "model": "m", "instructions": "Be brief.", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 50, "reasoning": {"effort": "high"}, "parallel_tool_calls": False, "stream": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                  "text": "need the tool"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
                  {"role": "user", "content": "And tomorrow?"}]})
    (chat,) = parsed.prompts
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert chat[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert chat[2]["reasoning_content"] == "need the tool" and chat[3]["content"] == "sunny"
    assert parsed.sampling["max_tokens"] == 50 and parsed.stream and parsed.chat.template_kwargs["reasoning_effort"] == "high"
    assert (parsed.chat.tool_choice, parsed.chat.function, parsed.chat.parallel_tool_calls) == \
        ("function", "get_weather", False)
    assert parsed.structured is not None and echo["tools"] == [TOOL] and echo["instructions"] == "Be brief."


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stores none"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "stores none"),
    ({"input": "hi", "background": True}, "background", "store"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
    ({"input": [{"type": "web_search_call"}]}, "input", "not supported"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "only 'function'"),
    ({}, "input", "required"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens'"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"input": "hi", "tools": True}, "tools", "must be a list"),
    ({"input": "hi", "include": "reasoning.encrypted_content"}, "include", "must be a list"),
    ({"input": [{"type": "reasoning", "summary": "thought"}, {"role": "user", "content": "hi"}]}, "input",
     "input[0].summary must be a list"),
    ({"input": [{"type": "reasoning", "content": [1]}, {"role": "user", "content": "hi"}]}, "input", "text parts"),
    ({"input": "hi", "n": 2}, "n", "one answer"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "hi", "metadata": ["a"]}, "metadata", "string values"),
    ({"input": "hi", "metadata": {"a": 1}}, "metadata", "string values"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs", "logprobs are not supported"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "logprobs are not supported"),
])
def test_bad_requests_name_the_responses_field(body, param, fragment):
    with pytest.raises(OpenAIError) as err:
        parse_responses(body)
    assert err.value.status == 400 and err.value.param == param and fragment in err.value.message, err.value.message


def test_events_open_and_close_items_in_order_and_end_in_the_final_response():
    builder = ResponseBuilder({"tools": [], "tool_choice": "auto"}, "m", 1)
    events = builder.start()
    for delta in (ChoiceDelta(reasoning="thinking"), ChoiceDelta(reasoning=" more", content="The answer"),
                  ChoiceDelta(content=" is", calls=[CallDelta(0, "", "call_a", "get_weather")]),
                  ChoiceDelta(calls=[CallDelta(0, '{"city": '), CallDelta(0, '"Paris"}')]),
                  ChoiceDelta(calls=[CallDelta(1, "{}", "call_b", "ping")])):
        events += builder.add(delta)
    events += builder.finish("completed", responses_usage(10, 20, 3))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_item.added") == 4
    final = events[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "completed"), ("message", "completed"),
                                                                  ("function_call", "completed")] + \
        [("function_call", "completed")]
    assert final["output"][0]["content"][0]["text"] == "thinking more"
    assert final["output"][1]["content"][0]["text"] == "The answer is"
    assert [(i["call_id"], i["name"], i["arguments"]) for i in final["output"][2:]] == \
        [("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "ping", "{}")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == '{"city": "Paris"}{}' and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert json.loads(json.dumps(final)) == final and final["store"] is False


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    builder = ResponseBuilder({}, "m", 1)
    builder.add(ChoiceDelta(content="cut"))
    (done, item_done, final) = builder.finish("incomplete", responses_usage(1, 1, 0), "max_output_tokens")[-3:]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert item_done["item"]["status"] == "incomplete"
