"""Structured outputs and tool calls with the official ``openai`` client against the real SmolLM2 (the
server every real-model test shares): a 135M model gets these right only because decoding is constrained."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import LiveServer

from tests.structured.conftest import load_cases

MODEL = "smollm2"
CASES = load_cases()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _ask_json(client: openai.OpenAI, name: str, schema: dict, temperature: float) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=MODEL, temperature=temperature, seed=5, max_tokens=400,
        messages=[{"role": "user", "content": f"Give me an example '{name}' record as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    return r.choices[0].message.content, r.choices[0].finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ten_schemas_parse_and_validate(client: openai.OpenAI, temperature: float) -> None:
    # all ten at once: they share the engine's batches, constrained side by side
    with ThreadPoolExecutor(len(CASES.SCHEMAS)) as pool:
        results = list(pool.map(lambda case: _ask_json(client, case[0], case[1], temperature), CASES.SCHEMAS))
    for (name, schema, _, _), (text, finish) in zip(CASES.SCHEMAS, results):
        assert finish == "stop", (name, finish, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.audit  # ~14 s on the real model: make test-audit
def test_json_object_and_guided_choice(client: openai.OpenAI) -> None:
    for temperature in (0.0, 0.8):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=temperature, seed=1,
                                           response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    choices = ["sunny", "rainy", "cloudy"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    prefix = ""
    for item in r.choices[0].logprobs.content:  # the masked distribution: only tokens a choice continues with
        assert item.top_logprobs and all(any(c.startswith(prefix + t.token) for c in choices)
                                         for t in item.top_logprobs), (prefix, item.top_logprobs)
        prefix += item.token
    c = client.completions.create(model=MODEL, prompt="Phone: ", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert len(c.choices[0].text) == 8 and c.choices[0].text[3] == "-"


def test_grammar_that_cannot_finish_ends_with_length(client: openai.OpenAI) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 60}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                       extra_body={"guided_json": schema})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert text.lstrip().startswith("[") and all(ch in "[0123456789, \n" for ch in text)  # valid so far


def _call(client: openai.OpenAI, tool_choice: object, stream: bool) -> tuple[str, str, str | None]:
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
              "max_tokens": 80, "temperature": 0, "parallel_tool_calls": False}
    if not stream:
        r = client.chat.completions.create(**kwargs)
        call = r.choices[0].message.tool_calls[0]
        assert len(r.choices[0].message.tool_calls) == 1 and call.id.startswith("call_") and call.type == "function"
        return call.function.name, call.function.arguments, r.choices[0].finish_reason
    name, args, ids, finish = None, "", set(), None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:  # the first piece: id, type and name, before any argument
                    ids.add(tc.id)
                    assert tc.function.name and not args
                    name = tc.function.name
                args += tc.function.arguments or ""
    assert len(ids) == 1
    return name, args, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_validate_streamed_or_not(client: openai.OpenAI, tool_choice: object) -> None:
    full = _call(client, tool_choice, stream=False)
    streamed = _call(client, tool_choice, stream=True)
    assert full == streamed  # the streamed pieces assemble to the same call
    name, args, finish = full
    assert finish == "tool_calls" and (name == "get_time" or tool_choice == "required")
    jsonschema.validate(json.loads(args), PARAMS[name])


def test_multi_turn_with_a_tool_result_reaches_an_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    history = [*ASK, {"role": "assistant", "content": msg.content, "tool_calls": [tc.model_dump() for tc in
                                                                                   msg.tool_calls]},
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18 degrees celsius, sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=48,
                                           temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert "<tool_call>" not in answer.message.content and "<|im_end|>" not in answer.message.content
    if answer.message.tool_calls:  # "auto": a call is allowed too, and then it is valid
        jsonschema.validate(json.loads(answer.message.tool_calls[0].function.arguments), PARAMS["get_weather"])
