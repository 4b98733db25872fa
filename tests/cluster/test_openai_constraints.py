"""Parsing of output constraints (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` fields) into :class:`StructuredOutputs`, and of the sampling controls (penalties,
logit_bias, min_tokens, bad_words, allowed_token_ids); their proto form across the gRPC hop, and
the 400s naming the field, from the front or from the engine. No model."""

from __future__ import annotations

import json

import pytest

from shardserve.cluster.engine.request import StructuredOutputs
from shardserve.cluster.frontend.openai_protocol import OpenAIError, engine_rejected, parse_chat, parse_completion
from shardserve.cluster.frontend.structured import structured_from_proto, structured_to_proto

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("fields,expected,param", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs.json_object(), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs.json_schema(SCHEMA), "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs.json_schema(SCHEMA), "structured_outputs"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     StructuredOutputs.json_schema(SCHEMA, True), "structured_outputs"),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputs.regex("[0-9]{3}"), "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs.choice(["yes", "no"]), "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs.grammar('root ::= "a"'),
     "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs.json_object(), "structured_outputs"),
    ({"guided_json": SCHEMA}, StructuredOutputs.json_schema(SCHEMA), "guided_json"),
    ({"guided_choice": ["a", "b"]}, StructuredOutputs.choice(["a", "b"]), "guided_choice"),
    ({"guided_regex": "a+"}, StructuredOutputs.regex("a+"), "guided_regex"),
])
def test_constraints_parse_on_both_endpoints(fields, expected, param):
    for parsed in (parse_chat({"messages": CHAT, **fields}), parse_completion({"prompt": "x", **fields})):
        assert (parsed.structured, parsed.structured_param) == (expected, param)
        assert structured_from_proto(structured_to_proto(parsed.structured)) == expected   # the gRPC hop


def test_no_constraint_by_default_and_for_text():
    for body in ({"messages": CHAT}, {"messages": CHAT, "response_format": {"type": "text"}}):
        assert parse_chat(body).structured is None


@pytest.mark.parametrize("fields,param,fragment", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "'response_format.json_schema' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format",
     "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs", "JSON schema"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "true"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "an object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "one output constraint"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
])
def test_bad_constraints_are_400_naming_the_field(fields, param, fragment):
    with pytest.raises(OpenAIError) as err:
        parse_chat({"messages": CHAT, **fields})
    assert (err.value.status, err.value.param) == (400, param)
    assert fragment in err.value.message


def test_engine_compile_errors_name_the_field_the_constraint_came_from():
    err = engine_rejected("structured_outputs: the JSON schema does not compile: bad", "messages", "response_format")
    assert (err.status, err.param) == (400, "response_format")
    assert engine_rejected("prompt must not be empty", "prompt", "response_format").param == "prompt"


def test_spec_checks_its_value():
    with pytest.raises(ValueError, match="kind"):
        StructuredOutputs("yaml", "x")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs("choice", ())
    assert hash(StructuredOutputs.json_schema({"a": 1})) == hash(StructuredOutputs.json_schema('{"a": 1}'))


# -- sampling controls --------------------------------------------------------------------------

def test_sampling_controls_parse_into_proto_fields_and_back():
    from shardserve.cluster.replica.grpc_server import sampling_from_proto
    from shardserve.proto import inference_pb2 as pb

    body = {"messages": CHAT, "presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.1,
            "logit_bias": {"50256": -100, "7": 2.5}, "min_tokens": 3, "max_tokens": 9, "bad_words": ["foo", " bar"],
            "allowed_token_ids": [1, 2, 3], "response_format": {"type": "json_object"}}
    parsed = parse_chat(body)
    msg = pb.SamplingParams(**parsed.sampling)
    params = sampling_from_proto(msg)   # the replica's side of the gRPC hop
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.25,
                                                                                                pytest.approx(1.1))
    assert params.logit_bias == {50256: -100.0, 7: 2.5} and params.min_tokens == 3 and params.max_tokens == 9
    assert params.bad_words == ["foo", " bar"] and params.allowed_token_ids == [1, 2, 3]
    default = sampling_from_proto(pb.SamplingParams(**parse_completion({"prompt": "x"}).sampling))
    assert (default.presence_penalty, default.repetition_penalty, default.logit_bias, default.min_tokens,
            default.bad_words, default.allowed_token_ids) == (0.0, 1.0, None, 0, [], None)


@pytest.mark.parametrize("fields,param,fragment", [
    ({"logit_bias": {"12": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"12": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias", "an object"),
    ({"logit_bias": {"1": "x"}}, "logit_bias", "a number"),
    ({"frequency_penalty": -2.1}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "[0, 4]"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    ({"bad_words": [""]}, "bad_words", "non-empty strings"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"allowed_token_ids": [1, True]}, "allowed_token_ids", "token ids"),
])
def test_bad_sampling_controls_are_400_naming_the_field(fields, param, fragment):
    with pytest.raises(OpenAIError) as err:
        parse_completion({"prompt": "x", **fields})
    assert (err.value.status, err.value.param) == (400, param)
    assert fragment in err.value.message


@pytest.mark.parametrize("message,param", [
    ("logit_bias: token id 99999 is outside the vocabulary [0, 49152)", "logit_bias"),
    ("allowed_token_ids: token id 49152 is outside the vocabulary [0, 49152)", "allowed_token_ids"),
    ("min_tokens must be in [0, max_tokens (4)], got 5", "min_tokens"),
    ("prompt token ids must be in [0, 49152)", "prompt"),
])
def test_engine_rejections_name_the_field_their_message_starts_with(message, param):
    assert engine_rejected(message, "prompt").param == param


def test_engine_checks_token_ids_against_the_vocabulary():
    from shardserve.cluster.engine.request import SamplingParams

    SamplingParams(logit_bias={49151: 1.0}, allowed_token_ids=[0]).validate(49152)
    for params, fragment in ((SamplingParams(logit_bias={49152: 1.0}), "logit_bias: token id 49152 is outside"),
                             (SamplingParams(allowed_token_ids=[-1]), "allowed_token_ids: token id -1"),
                             (SamplingParams(logit_bias={3: 100.5}), "logit_bias values must be in [-100, 100]"),
                             (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be in (0, 100]")):
        with pytest.raises(ValueError) as err:
            params.validate(49152)
        assert str(err.value).startswith(fragment)
