"""tools / tool_choice checks (each a ValueError naming the field) and tool-call ids."""

from __future__ import annotations

import re

import pytest

from lightinfer.structured import ToolChoice, ToolSpec, make_tool_call_id, parse_tool_choice, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_tools_read() -> None:
    [t] = parse_tools([WEATHER])
    assert t == ToolSpec("get_weather", WEATHER["function"]["parameters"], "Weather now")
    [bare] = parse_tools([{"type": "function", "function": {"name": "now"}}])
    assert bare.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert parse_tools(None) == [] and parse_tools([t]) == [t]


@pytest.mark.parametrize(("tools", "message"), [
    ({"type": "function"}, "tools: must be a list"),
    (["x"], r"tools\[0\]: must be an object"),
    ([{"type": "retrieval"}], r"tools\[0\]\.type: only \"function\""),
    ([{"type": "function"}], r"tools\[0\]\.function: must be an object"),
    ([{"type": "function", "function": {"name": "bad name!"}}], r"tools\[0\]\.function\.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], r"tools\[0\]\.function\.description"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     r"tools\[1\]\.function\.parameters: is not a valid JSON Schema"),
    ([WEATHER, WEATHER], r"tools\[1\]\.function\.name: 'get_weather' is defined twice"),
])
def test_bad_tools(tools, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)


def test_tool_choice() -> None:
    tools = parse_tools([WEATHER])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tool_choice(named, tools) == ToolChoice("named", "get_weather")
    for bad, message in [("sometimes", "tool_choice: must be"), ("required", "needs at least one tool"),
                         ({"type": "function", "function": {"name": "nope"}}, "'nope' is not in tools"),
                         ({"type": "function"}, "tool_choice.function.name"), ({"name": "x"}, "an object must be")]:
        with pytest.raises(ValueError, match=message):
            parse_tool_choice(bad, tools if message != "needs at least one tool" else [])


def test_ids() -> None:
    a, b = make_tool_call_id(), make_tool_call_id()
    assert a != b and re.fullmatch(r"call_[A-Za-z0-9]{24}", a)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", make_tool_call_id("mistral"))  # Mistral's templates demand 9
