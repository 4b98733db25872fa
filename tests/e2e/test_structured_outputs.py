"""Structured outputs on the real SmolLM2 (single-process engine, xgrammar against its byte-level
BPE vocabulary): the JSON schemas users send ($ref/$defs, anyOf with null, enums with non-ASCII
values, nested arrays, additionalProperties false) give outputs that parse and validate with
``jsonschema``, greedy and sampled (n > 1 seeded choices batched together); json_object, regex,
choice and EBNF grammar outputs are in their language; a constraint that does not compile is a
ValueError naming the problem, and the next request is served; no matcher outlives its request."""

from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest

from shardserve.cluster.engine.grammar import num_live_grammars
from shardserve.cluster.engine.request import SamplingParams, StructuredOutputs

pytestmark = pytest.mark.slow

PERSON = {
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                       "name": {"type": "string", "maxLength": 12}},
                      "required": ["kind", "name"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "東京", "Zürich"]},
        "email": {"anyOf": [{"type": "string", "maxLength": 24}, {"type": "null"}]},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 1},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                            "maxItems": 2}, "maxItems": 1},
    },
    "required": ["name", "age", "city", "email", "pets", "grid"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, city, email, pets and a small grid."}]


def live_grammars() -> int:
    gc.collect()
    return num_live_grammars()


def test_json_schema_outputs_validate_greedy_and_sampled(smollm2_llm):
    """One greedy answer and two seeded samples of the same constraint (what ``n=2`` sends) on one
    line, batched together with a json_object request."""
    one_line = StructuredOutputs.json_schema(PERSON, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=120, temperature=0, structured_outputs=StructuredOutputs.json_schema(PERSON))] + [
        SamplingParams(max_tokens=120, temperature=0.8, seed=seed, structured_outputs=one_line) for seed in (1, 2)] + [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs.json_object(True))]
    capital = [{"role": "user", "content": 'Give the capital of France as a JSON object with the key "capital".'}]
    done = smollm2_llm.generate([ASK] * 3 + [capital], params)
    for d in done:
        assert d.finish_reason == "stop", d.text
    for d in done[:3]:
        jsonschema.validate(json.loads(d.text), PERSON)
    assert all("\n" not in d.text for d in done[1:])
    assert isinstance(json.loads(done[3].text), dict)
    assert live_grammars() == 0


def test_regex_choice_and_grammar_outputs_are_in_their_language(smollm2_llm):
    cases = [(StructuredOutputs.regex(r"[0-9]{3}-[a-z]{2,6}"), r"[0-9]{3}-[a-z]{2,6}"),
             (StructuredOutputs.choice(["Paris", "Lyon", "東京"]), r"Paris|Lyon|東京"),
             (StructuredOutputs.grammar('root ::= ("yes" | "no") ", " [a-z]+ "."'), r"(yes|no), [a-z]+\.")]
    params = [SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec) for spec, _ in cases]
    done = smollm2_llm.generate([[{"role": "user", "content": "What is the capital of France?"}]] * 3, params)
    for d, (_, pattern) in zip(done, cases):
        assert d.finish_reason == "stop" and re.fullmatch(pattern, d.text), d.text


@pytest.mark.parametrize("spec,fragment", [
    (StructuredOutputs.json_schema({"type": "objekt"}), 'the JSON schema does not compile: Unsupported type "objekt"'),
    (StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "the JSON schema does not compile"),
    (StructuredOutputs.regex("a(b"), "the regex does not compile"),
    (StructuredOutputs.grammar("root ::= undefined_rule"), "the grammar does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_next_request_is_served(smollm2_llm, spec, fragment):
    ids = smollm2_llm.encode("Hello")
    with pytest.raises(ValueError, match=re.escape(fragment)) as err:
        smollm2_llm.core.add_request(ids, SamplingParams(max_tokens=4, structured_outputs=spec))
    assert str(err.value).startswith("structured_outputs: ")
    assert not smollm2_llm.core.has_unfinished()
    (done,) = smollm2_llm.generate([ids], SamplingParams(max_tokens=4, temperature=0,
                                                         structured_outputs=StructuredOutputs.choice(["ok"])))
    assert done.text == "ok"
    assert live_grammars() == 0
