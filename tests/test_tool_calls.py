"""Tool-call parsing (whole and streamed) and the `tool_choice` schemas: pure unit tests."""

from __future__ import annotations

import json
import random
import re

import llguidance
import pytest

from braid.server.tool_calls import (
    TOOL_CALL_PARSERS,
    DeepSeekV3Parser,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolCallParser,
    calls_from_required_output,
    named_tool_schema,
    new_call_id,
    parser_for,
    required_tools_schema,
)

# DeepSeek-V3's markers written with escapes, so that a look-alike character in the module fails.
DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def ds(name: str, args: str) -> str:
    return f"{DS_BEGIN}function{DS_SEP}{name}\n```json\n{args}\n```{DS_END}"


def summary(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def parsed(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parser.parse(text)
    return content, summary(calls)


HERMES_TEXTS = [
    "",
    "Just an answer.",
    "  \n",
    hermes("get_weather", '{"city": "Paris"}'),
    "Let me check.\n\n" + hermes("a", "{}") + "\n" + hermes("b", '{"x": [1, 2]}') + "\n",
    '<tool_call>{"name": "f", "parameters": {"q": "é"}}</tool_call>',
    "<tool_call>\n{not json}\n</tool_call> and then",
    hermes("a", "{}") + "\n<tool_call>\n{broken\n</tool_call>\nafter",
    hermes("a", "{}") + '\n<tool_call>\n{"name": "b", "arguments": {"y": 1}}',
    "Text <tool_call>\n{unterminated",
    "a <tool_ b <tool_call without end",
    "1 < 2 and <b>bold</b> <tool",
]
LLAMA_TEXTS = [
    "",
    "Plain answer.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"s": "x;y"}}',
    '  \n{"name": "a", "parameters": {"n": 1}};',
    '{"name": "a", "parameters": {}} and more text',
    '{"not": "a call"}',
    '{"name": "a", "parameters": {',
    "<|python_tag|>brave_search.call(query='x')",
    "<|pyth",
    "{} is an empty object",
]
DS_TEXTS = [
    "",
    "No tools needed.",
    DS_CALLS_BEGIN + ds("get_weather", '{"city": "Paris"}') + DS_END + DS_CALLS_END,
    "Sure." + DS_CALLS_BEGIN + ds("a", "{}") + "\n" + ds("b", '{"k": "v"}') + DS_CALLS_END,
    DS_CALLS_BEGIN + f"{DS_BEGIN}function{DS_SEP}a\n```json\n{{oops\n```{DS_END}" + DS_CALLS_END,
    DS_CALLS_BEGIN + f'{DS_BEGIN}a{DS_SEP}{{"v31": true}}{DS_END}' + DS_CALLS_END,
    DS_CALLS_BEGIN + f'{DS_BEGIN}function{DS_SEP}a\n```json\n{{"cut": 1}}',
    "half a marker <\uff5ctool\u2581ca",
]
CASES = [
    (HermesParser, HERMES_TEXTS),
    (Llama3JsonParser, LLAMA_TEXTS),
    (DeepSeekV3Parser, DS_TEXTS),
]


def test_tool_call_shape() -> None:
    call_id = new_call_id()
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id) and call_id != new_call_id()
    assert ToolCall("call_1", "f", '{"a": 1}').to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }


def test_hermes() -> None:
    p = HermesParser()
    assert parsed(p, "Just an answer.") == ("Just an answer.", [])
    assert parsed(p, hermes("get", '{"city": "Paris"}')) == (None, [("get", {"city": "Paris"})])
    two = "Let me check.\n\n" + hermes("a", "{}") + "\n" + hermes("b", '{"x": [1, 2]}') + "\n"
    assert parsed(p, two) == ("Let me check.\n\n", [("a", {}), ("b", {"x": [1, 2]})])
    assert parsed(p, '<tool_call> {"name": "f", "parameters": {"q": 1}} </tool_call>') == (
        None,
        [("f", {"q": 1})],
    )
    bad = "<tool_call>\n{not json}\n</tool_call> and then"
    assert parsed(p, bad) == (bad, [])
    # An unterminated last block is a call when its JSON is whole, else it stays content.
    unterminated = hermes("a", "{}") + '\n<tool_call>{"name": "b"}'
    assert parsed(p, unterminated) == (None, [("a", {}), ("b", {})])
    assert parsed(p, "Text <tool_call>\n{unterminated") == ("Text <tool_call>\n{unterminated", [])
    # Arguments are re-serialized: json.dumps spacing, no ASCII escapes.
    text = '<tool_call>{"name":"f","arguments":{"s":"\\u00e9","n":[1,2]}}</tool_call>'
    (call,) = p.parse(text)[1]
    assert call.arguments == '{"s": "é", "n": [1, 2]}'


def test_llama3_json() -> None:
    p = Llama3JsonParser()
    assert parsed(p, "Plain answer.") == ("Plain answer.", [])
    assert parsed(p, '{"name": "get", "parameters": {"city": "Paris"}}') == (
        None,
        [("get", {"city": "Paris"})],
    )
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"s": "x;y"}}'
    assert parsed(p, two) == (None, [("a", {}), ("b", {"s": "x;y"})])
    for content in ['{"name": "a", "parameters": {}} and more', '{"not": "a"}', '{"name": "a"']:
        assert parsed(p, content) == (content, [])


def test_deepseek_v3() -> None:
    p = DeepSeekV3Parser()
    assert parsed(p, "No tools needed.") == ("No tools needed.", [])
    one = DS_CALLS_BEGIN + ds("get", '{"city": "Paris"}') + DS_CALLS_END
    assert parsed(p, one) == (None, [("get", {"city": "Paris"})])
    two = "Sure." + DS_CALLS_BEGIN + ds("a", "{}") + "\n" + ds("b", '{"k": "v"}') + DS_CALLS_END
    assert parsed(p, two) == ("Sure.", [("a", {}), ("b", {"k": "v"})])
    bad_call = f"{DS_BEGIN}function{DS_SEP}a\n```json\n{{oops\n```{DS_END}"
    assert parsed(p, "x" + DS_CALLS_BEGIN + bad_call + DS_CALLS_END) == ("x" + bad_call, [])
    v31 = DS_CALLS_BEGIN + f'{DS_BEGIN}a{DS_SEP}{{"n": 1}}{DS_END}' + DS_CALLS_END
    assert parsed(p, v31) == (None, [("a", {"n": 1})])


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if text else []
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def streamed(parser: ToolCallParser, deltas: list[str]) -> tuple[str | None, list]:
    stream = parser.stream()
    pieces, calls = [], []
    for delta in deltas:
        content, new = stream.feed(delta)
        pieces.append(content)
        calls += new
    content, new = stream.finish()
    content, calls = "".join(pieces) + content, calls + new
    return (None if calls and not content.strip() else content), summary(calls)


@pytest.mark.parametrize("parser_cls,texts", CASES, ids=[c[0].name for c in CASES])
def test_streaming_equals_parse(parser_cls: type[ToolCallParser], texts: list[str]) -> None:
    rng = random.Random(0)
    parser = parser_cls()
    for text in texts:
        whole = parsed(parser, text)
        assert streamed(parser, list(text)) == whole, text
        for _ in range(40):
            assert streamed(parser, random_split(text, rng)) == whole, text


def test_stream_holds_partial_markers_and_blank_gaps() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool_") == ("Hello ", [])
    assert stream.feed("box> x") == ("<tool_box> x", [])
    stream = HermesParser().stream()
    assert stream.feed(hermes("a", "{}"))[1][0].name == "a"  # a call comes out once closed
    assert stream.feed("\n") == ("", [])  # the gap before a next call is not content
    assert stream.feed(hermes("b", "{}"))[0] == ""
    assert stream.finish() == ("", [])
    stream = DeepSeekV3Parser().stream()
    assert stream.feed("ok <\uff5ctool") == ("ok ", [])
    assert stream.finish() == ("<\uff5ctool", [])
    stream = Llama3JsonParser().stream()
    assert stream.feed(' {"name": "a"') == ("", [])
    assert stream.finish() == (' {"name": "a"', [])
    stream = Llama3JsonParser().stream()
    assert stream.feed("<|py") == ("", [])
    assert stream.feed("thon says hi") == ("<|python says hi", [])
    assert stream.feed(" more") == (" more", [])


def test_parser_for() -> None:
    assert TOOL_CALL_PARSERS.keys() == {"hermes", "llama3_json", "deepseek_v3"}
    qwen = "{%- if tools %}...<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>"
    deepseek = "{{'<｜Assistant｜>' + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}"
    llama31 = "{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
    llama32 = '{"name": function name, "parameters": dictionary}{%- if role == "ipython" %}'
    assert isinstance(parser_for(None, qwen), HermesParser)
    assert isinstance(parser_for("auto", deepseek), DeepSeekV3Parser)
    assert isinstance(parser_for(None, llama31), Llama3JsonParser)
    assert isinstance(parser_for("auto", llama32), Llama3JsonParser)
    assert parser_for(None, "{{ messages }}") is None and parser_for("auto", None) is None
    assert isinstance(parser_for("hermes", None), HermesParser)
    with pytest.raises(ValueError, match="'mistral'.*auto, none, deepseek_v3, hermes, llama3_json"):
        parser_for("mistral", qwen)


def function(name: str, parameters: dict | None = None) -> dict:
    body = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [function("get_weather", WEATHER), function("get_time")]


def assert_valid_grammar(schema: dict) -> None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert (is_error, messages) == (False, [])


def test_named_tool_schema() -> None:
    assert named_tool_schema(TOOLS, "get_weather") == WEATHER
    assert named_tool_schema(TOOLS, "get_time") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'nope'.*get_weather, get_time"):
        named_tool_schema(TOOLS, "nope")


def test_required_tools_schema() -> None:
    schema = required_tools_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first == {
        "type": "object",
        "properties": {"name": {"type": "string", "const": "get_weather"}, "parameters": WEATHER},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert_valid_grammar(schema)
    with pytest.raises(ValueError, match="at least one"):
        required_tools_schema([])


def test_required_tools_schema_hoists_defs() -> None:
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    params = {
        "type": "object",
        "properties": {"c": {"$ref": "#/$defs/City"}},
        "$defs": {"City": city},
    }
    schema = required_tools_schema([function("a", params), function("b", params)])
    assert schema["$defs"] == {"City": city}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in params  # the caller's tools are left as they were
    assert_valid_grammar(schema)
    other = {**params, "$defs": {"City": {"type": "integer"}}}
    with pytest.raises(ValueError, match="'City'"):
        required_tools_schema([function("a", params), function("b", other)])


def test_calls_from_required_output() -> None:
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    calls = calls_from_required_output(output)
    assert summary(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({call.id for call in calls}) == 2
    for cut_or_wrong in [output[:30], '{"name": "a"}', '[{"parameters": {}}]']:
        assert calls_from_required_output(cut_or_wrong) == []


def test_defs_that_are_not_an_object_are_refused():
    """A request's `$defs` must be a map of schemas (a list was a 500 through the server)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": [1]}}}]
    with pytest.raises(ValueError, match="'f' must be an object"):
        required_tools_schema(tools)
