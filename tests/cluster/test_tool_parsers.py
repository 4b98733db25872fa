"""Conformance of every tool-call parser on one table: the same calls rendered in each family's
format (as its chat template writes them), parsed whole and streamed with the text split at every
position, char by char, and in token-sized groups (special markers whole, several tokens per
delta as MTP delivers them). The oracle is the table itself: names, ``json.loads`` of the
arguments, and the content around the calls. Pure Python, no model."""

from __future__ import annotations

import json
import random

import pytest

from shardserve.cluster.frontend.tool_parsers import TOOL_PARSERS, collect, get_tool_parser, parse_text
from shardserve.cluster.frontend.tool_parsers.forced import NamedCallParser, RequiredCallsParser

WEATHER = ("get_weather", {"city": "Paris", "days": 3})
ALL_TYPES = ("record", {"s": 'héllo "quoted" \\ back\nline', "i": -42, "f": 2.5, "yes": True, "no": False,
                        "nothing": None, "arr": [1, "two", [3.0]], "obj": {"k": {"deep": [True]}}})
UNICODE = ("翻译", {"text": "你好，世界 🌍", "lang": "日本語"})
EMPTY = ("ping", {})
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "record": {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "f": {"type": "number"}, "yes": {"type": "boolean"},
        "no": {"type": "boolean"}, "nothing": {"type": "null"}, "arr": {"type": "array"}, "obj": {"type": "object"}}},
    "翻译": {"type": "object", "properties": {"text": {"type": "string"}, "lang": {"type": "string"}}},
    "ping": {"type": "object", "properties": {}},
}


def _value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def hermes(calls) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                     for n, a in calls)


def llama3_json(calls) -> str:
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def deepseek_v3(calls) -> str:
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```"
                     "<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v31(calls) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}<｜tool▁call▁end｜>"
                   for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v32(calls) -> str:
    """As DeepSeek-V3.2's encode_arguments_to_dsml / tool_calls_template write it."""
    dsml = "｜DSML｜"
    invokes = []
    for name, args in calls:
        params = "\n".join(f'<{dsml}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                           f"{_value(v)}</{dsml}parameter>" for k, v in args.items())
        invokes.append(f'<{dsml}invoke name="{name}">\n{params}\n</{dsml}invoke>')
    return f"<{dsml}function_calls>\n" + "\n".join(invokes) + f"\n</{dsml}function_calls>"


def glm45(calls) -> str:
    return "\n".join(f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value(v)}</arg_value>\n"
                                                   for k, v in a.items()) + "</tool_call>" for n, a in calls)


def glm47(calls) -> str:
    return "".join(f"<tool_call>{n}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{_value(v)}</arg_value>"
                                               for k, v in a.items()) + "</tool_call>" for n, a in calls)


# family -> (renderer, markers that are one token each, calls may follow content, malformed examples)
FAMILIES = {
    "hermes": (hermes, ("<tool_call>", "</tool_call>"), True,
               ["<tool_call>not json</tool_call> tail", '<tool_call>\n{"arguments": {}}\n</tool_call>',
                '<tool_call>{"name": 5}</tool_call>']),
    "llama3_json": (llama3_json, ("<|python_tag|>",), False, ['{"answer": 42}', '{"name": ["x"], "parameters": {}}']),
    "deepseek_v3": (deepseek_v3, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                  "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"), True,
                    ["<｜tool▁calls▁begin｜>oops<｜tool▁calls▁end｜> after"]),
    "deepseek_v31": (deepseek_v31, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                    "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"), True,
                     ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{\"x\": 1}<｜tool▁sep｜>"]),
    "deepseek_v32": (deepseek_v32, ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke",
                                    "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>"), True,
                     ["<｜DSML｜function_calls>\nplain words\n</｜DSML｜function_calls>",
                      '<｜DSML｜function_calls>\n<｜DSML｜invoke nome="x">\n</｜DSML｜invoke>']),
    "glm45": (glm45, ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"), True,
              ['<tool_call>{"name": "x", "arguments": {}}</tool_call>']),
    "glm47": (glm47, ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"), True,
              ["<tool_call>two words{</tool_call>"]),
}
SCENARIOS = {
    "after_content": ("Let me check that.", [WEATHER]),
    "several": ("", [WEATHER, ALL_TYPES]),
    "unicode_and_empty": ("", [UNICODE, EMPTY]),
}


def make_ids():
    counter = iter(range(10**9))
    return lambda: f"call_{next(counter)}"


def new_parser(family: str):
    return get_tool_parser(family)(SCHEMAS, make_ids())


def result(parsed) -> tuple:
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


def feed_pieces(family: str, pieces: list[str]):
    """Parse ``pieces`` as one stream; checks the delta shape; returns the collected answer."""
    parser = new_parser(family)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    seen = set()
    for delta in deltas:
        for piece in delta.calls:
            first = piece.index not in seen
            assert (piece.id is not None) == first and (piece.name is not None) == first, (family, piece)
            if first:
                assert piece.index == len(seen), "calls are numbered in order"
                seen.add(piece.index)
    return collect(deltas)


def token_pieces(text: str, markers: tuple[str, ...], group: int, seed: int) -> list[str]:
    """``text`` as a model streams it: markers as single tokens, other text in 1-4 character
    tokens, ``group`` tokens per delta (speculative decoding delivers several at once)."""
    rng, tokens, i = random.Random(seed), [], 0
    while i < len(text):
        marker = next((m for m in markers if text.startswith(m, i)), None)
        size = len(marker) if marker else rng.randint(1, 4)
        tokens.append(text[i:i + size])
        i += size
    return ["".join(tokens[j:j + group]) for j in range(0, len(tokens), group)]


def assert_every_split(family: str, text: str, expected: tuple, markers: tuple[str, ...]) -> None:
    whole = parse_text(new_parser(family), text)
    assert result(whole) == expected
    for cut in range(len(text) + 1):
        assert result(feed_pieces(family, [text[:cut], text[cut:]])) == expected, (family, cut)
    assert result(feed_pieces(family, list(text))) == expected, family
    for group in (1, 2, 3, 5):
        assert result(feed_pieces(family, token_pieces(text, markers, group, seed=group))) == expected, (family, group)


def expected_calls(calls) -> list[tuple[str, dict]]:
    return [(name, args) for name, args in calls]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_parse_the_same_whole_and_split_anywhere(family, scenario):
    render, markers, after_content, _ = FAMILIES[family]
    content, calls = SCENARIOS[scenario]
    text = (content + "\n\n" if content else "") + render(calls)
    whole = parse_text(new_parser(family), text)
    if content and not after_content:        # llama3_json: calls only at the start; the rest is text
        assert result(whole) == (text, [])
        return
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == expected_calls(calls)
    assert len({c.id for c in whole.calls}) == len(calls) and all(c.id for c in whole.calls)
    assert_every_split(family, text, result(whole), markers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_markup_in_code_is_content(family):
    render, markers, _, _ = FAMILIES[family]
    text = f"An example:\n```\n{render([WEATHER])}\n```\nand inline `{render([EMPTY])}` too."
    assert_every_split(family, text, (text, []), markers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_malformed_markup_is_content(family):
    _, markers, _, malformed = FAMILIES[family]
    for text in malformed:
        assert_every_split(family, text, (text, []), markers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_text_without_calls_is_returned_exactly(family):
    text = "  Plain answer: 1 < 2, a {brace}, `code` and ``` fences\n\n"
    assert_every_split(family, text, (text, []), FAMILIES[family][1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cut_anywhere_never_fails_and_streams_as_whole(family):
    """Every prefix at a token boundary is an answer cut by max_tokens: no error, the same result
    streamed, no markup in the content, and an announced call keeps its name (its arguments are
    unfinished)."""
    render, markers, _, _ = FAMILIES[family]
    tokens = token_pieces(render([WEATHER, ALL_TYPES]), markers, 1, seed=3)
    for end in range(len(tokens) + 1):
        prefix = "".join(tokens[:end])
        whole = result(parse_text(new_parser(family), prefix))
        assert result(feed_pieces(family, token_pieces(prefix, markers, 2, seed=end))) == whole
        assert all(name in SCHEMAS for name, _ in whole[1])
        assert "<tool_call>" not in whole[0] and "｜" not in whole[0]   # no markup leaks on a cut


@pytest.mark.parametrize("family", list(FAMILIES))
def test_random_damage_never_raises(family):
    """Markup with characters dropped, doubled or swapped: parsed without an exception, and
    split streams agree with the whole text."""
    render, markers, _, _ = FAMILIES[family]
    base = "Sure.\n" + render([WEATHER, UNICODE])
    rng = random.Random(7)
    for trial in range(60):
        chars = list(base)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(chars))
            op = rng.choice(("drop", "double", "swap"))
            if op == "drop":
                del chars[at]
            elif op == "double":
                chars.insert(at, chars[at])
            elif at + 1 < len(chars):
                chars[at], chars[at + 1] = chars[at + 1], chars[at]
        text = "".join(chars)
        whole = result(parse_text(new_parser(family), text))
        cut = rng.randrange(len(text) + 1)
        assert result(feed_pieces(family, [text[:cut], text[cut:]])) == whole, (family, trial)


def test_dsml_string_attribute_and_schema_types():
    """string="false" values are JSON; a value whose schema type disagrees with its attribute
    follows the schema where it can; text that is not JSON stays a string."""
    dsml = "｜DSML｜"
    text = (f'<{dsml}function_calls>\n<{dsml}invoke name="record">\n'
            f'<{dsml}parameter name="i" string="true">7</{dsml}parameter>\n'
            f'<{dsml}parameter name="s" string="false">007</{dsml}parameter>\n'
            f'<{dsml}parameter name="arr" string="false">[1, {{"a": null}}]</{dsml}parameter>\n'
            f'<{dsml}parameter name="extra" string="false">not json</{dsml}parameter>\n'
            f'<{dsml}parameter name="f" string="false"> 2.50 </{dsml}parameter>\n'
            f"</{dsml}invoke>\n</{dsml}function_calls>")
    (call,) = parse_text(new_parser("deepseek_v32"), text).calls
    assert json.loads(call.arguments) == {"i": 7, "s": "007", "arr": [1, {"a": None}], "extra": "not json", "f": 2.5}


def test_registry_names_and_unknown_name():
    assert {"deepseek_v32", "deepseek_v3", "glm45", "hermes", "llama3_json"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose one of: deepseek_v3"):
        get_tool_parser("nope")


def test_forced_calls_stream_as_generated():
    """tool_choice named: the answer is the arguments; required: an array of calls."""
    args = json.dumps(ALL_TYPES[1], ensure_ascii=False)
    for cut in range(len(args) + 1):
        parser = NamedCallParser("record", SCHEMAS, make_ids())
        got = collect([parser.feed(" " + args[:cut]), parser.feed(args[cut:]), parser.finish()])
        assert result(got) == ("", [("record", args)])
    array = json.dumps([{"name": n, "parameters": a} for n, a in (WEATHER, UNICODE, EMPTY)], ensure_ascii=False)
    expected = ("", [(n, json.dumps(a, ensure_ascii=False)) for n, a in (WEATHER, UNICODE, EMPTY)])
    for cut in range(len(array) + 1):
        parser = RequiredCallsParser(SCHEMAS, make_ids())
        assert result(collect([parser.feed(array[:cut]), parser.feed(array[cut:]), parser.finish()])) == expected
