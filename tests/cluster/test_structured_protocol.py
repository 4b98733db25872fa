"""Parsing of output constraints: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` fields into :class:`StructuredOutputs`, their proto form, and the 400s. No model."""

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
