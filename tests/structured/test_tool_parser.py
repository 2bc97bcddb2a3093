"""Tool-call parsers on fixed strings (two parallel calls included), streaming deltas that assemble to
the same calls, and the format detection from chat templates."""

from __future__ import annotations

import itertools
import json

import pytest

from lightinfer.structured import (
    FALLBACK_FORMAT,
    ToolCallStreamParser,
    detect_tool_call_format,
    get_tool_call_format,
    parse_tool_calls,
)

ADD, WEATHER = '{"a": 1, "b": {"c": "}{"}}', '{"city": "Paris"}'  # braces inside strings too
TEXTS = {
    "hermes": f'Let me check.\n<tool_call>\n{{"name": "add", "arguments": {ADD}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "add", "parameters": {ADD}}}; '
                   f'{{"name": "get_weather", "parameters": {WEATHER}}}',
    "mistral": f'[TOOL_CALLS] [{{"name": "add", "arguments": {ADD}}}, {{"name": "get_weather", "arguments": {WEATHER}}}]',
}


def counter():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """Client side of OpenAI streaming: concatenate content and each index's argument pieces."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:  # the first delta of a call carries id, type and name
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"], tc
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert "id" not in tc and "name" not in tc["function"]
            calls[tc["index"]][2] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("fmt", list(TEXTS))
def test_two_parallel_calls(fmt) -> None:
    parsed = parse_tool_calls(TEXTS[fmt], fmt, counter())
    assert parsed.content == ("Let me check." if fmt == "hermes" else None)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("call_0", "add", json.loads(ADD)), ("call_1", "get_weather", json.loads(WEATHER))]
    assert parsed.tool_calls[0].to_openai() == {"id": "call_0", "type": "function",
                                                "function": {"name": "add", "arguments": ADD}}


@pytest.mark.parametrize("fmt", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_streaming_assembles_to_the_same_calls(fmt, chunk) -> None:
    text = TEXTS[fmt]
    whole = parse_tool_calls(text, fmt, counter())
    p = ToolCallStreamParser(fmt, counter())
    deltas = [d for i in range(0, len(text), chunk) for d in p.feed(text[i:i + chunk])] + p.finish()
    content, calls = assemble(deltas)
    assert p.tool_calls == whole.tool_calls
    assert content == whole.content
    assert calls == [(c.id, c.name, c.arguments) for c in whole.tool_calls]
    if chunk == 1:  # arguments really arrive in pieces, and the name before any of them
        pieces = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
        assert len(pieces) > 4
        assert deltas.index(next(d for d in deltas if "tool_calls" in d)) < deltas.index(pieces[0])


def test_marker_prefix_is_held_back_until_decided() -> None:
    p = ToolCallStreamParser("hermes", counter())
    assert p.feed("Hi <tool") == [{"content": "Hi"}]  # " <tool" might open a call
    assert p.feed("box> ok") == [{"content": " <toolbox> ok"}]
    assert p.finish() == []
    q = ToolCallStreamParser("mistral", counter())
    assert q.feed("[TOOL_CALLS] [{\"name\": \"f\"") == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}]}]
    assert q.feed(', "arguments": {"x"') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}]
    assert q.feed(": 1}}]") == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    ("hermes", "Just text.", "Just text.", []),
    ("hermes", "  \n", None, []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is content
    ("llama3_json", "The answer is 42.", "The answer is 42.", []),
    ("llama3_json", '{"name": "f", "parameters": {}}', None, [("f", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", "{}")]),  # no arguments: {}
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": "{\\"x\\": 1}"}]', None, [("f", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1', '{"name": "f", "arguments": {"x": 1', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.', "Done.", [("f", "{}")]),
    ("llama3_json", '{"parameters": {"x": 2}, "name": "g"}', None, [("g", '{"x": 2}')]),
])
def test_edge_cases(fmt, text, content, calls) -> None:
    parsed = parse_tool_calls(text, fmt, counter())
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


QWEN25 = ('{%- if tools %}{{- "<|im_start|>system\\n" }}# Tools\\n<tools>{%- for tool in tools %}{{ tool | tojson }}'
          '{%- endfor %}</tools>\\n\\nFor each function call, return a json object with function name and arguments '
          'within <tool_call></tool_call> XML tags{%- endif %}')
MISTRAL = ('{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
           '{{- tool_call.function|tojson }}{%- endfor %}{{- "]" + eos_token }}{%- endif %}')
LLAMA31 = ('{{- "<|start_header_id|>user<|end_header_id|>\\n\\n" -}}Given the following functions, respond with a '
           'JSON for a function call with its proper arguments.Respond in the format {"name": function name, '
           '"parameters": dictionary of argument name and its value}.{%- if builtin_tools is defined %}'
           '{{- "<|python_tag|>" }}{%- endif %}')
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}")


def test_detect_format() -> None:
    assert detect_tool_call_format(QWEN25).name == "hermes"
    assert detect_tool_call_format(MISTRAL).name == "mistral"
    assert detect_tool_call_format(LLAMA31).name == "llama3_json"
    assert detect_tool_call_format(LLAMA31.replace("<|python_tag|>", "")).name == "llama3_json"
    assert detect_tool_call_format(SMOLLM2).name == FALLBACK_FORMAT == "hermes"
    assert detect_tool_call_format(None).name == "hermes"
    assert detect_tool_call_format(QWEN25, override="mistral").name == "mistral"  # the flag wins
    assert get_tool_call_format("Qwen2.5").name == "hermes" and get_tool_call_format("llama3").name == "llama3_json"
    with pytest.raises(ValueError, match="tool-call parser 'pythonic' is unknown; use one of hermes, llama3_json"):
        detect_tool_call_format(QWEN25, override="pythonic")
