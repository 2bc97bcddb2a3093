"""Structured-output and tool requests that are wrong: each a 400 naming the field, before any generation
(fake engine: nothing here needs a model)."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import LiveServer

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0)


def _schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}

BAD_CHAT = [
    # a schema that is not valid JSON Schema
    (_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "response_format.json_schema.schema",
     "is not a valid JSON Schema"),
    # a keyword constrained decoding cannot enforce: said, not silently ignored
    (_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "response_format.json_schema.schema", "cannot enforce: uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
    # a regex that does not compile; an empty choice; a grammar that does not parse
    ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex", "cannot be used"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
    ({"extra_body": {"guided_grammar": "start: ("}}, "guided_grammar", "grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "json": {}}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice", "only one output constraint"),
    # tool_choice naming a tool that is not in tools; tools of another type; bad parameters
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "'get_time' is not in tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only \"function\" tools"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[1].function.parameters", "not a valid JSON Schema"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools instead"),
]


AUTH = {"Authorization": "Bearer test-key"}  # /stats needs the server's key, as /v1 does


@pytest.mark.parametrize("kwargs, param, needle", BAD_CHAT)
def test_chat_400_names_the_field(client: openai.OpenAI, fake_server: LiveServer, kwargs: dict, param: str,
                                  needle: str) -> None:
    before = httpx.get(f"{fake_server.url}/stats", headers=AUTH).json()["num_prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, **kwargs)
    body = e.value.body
    assert e.value.status_code == 400 and needle in body["message"], body
    assert body["param"] == param or body["message"].startswith(param), body
    assert httpx.get(f"{fake_server.url}/stats", headers=AUTH).json()["num_prompt_tokens"] == before  # nothing was generated


@pytest.mark.parametrize("messages, param, needle", [
    ([*MSG, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "messages[1].tool_call_id",
     "matches no tool call"),
    ([*MSG, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
     "messages[2].tool_call_id", "known ids: 'call_1'"),
    ([*MSG, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "{oops"}}]}],
     "messages[1].tool_calls[0].function.arguments", "is not valid JSON"),
    ([*MSG, {"role": "tool", "content": "x"}], "messages[1].tool_call_id", "needs the id"),
])
def test_bad_tool_history_is_400(client: openai.OpenAI, messages: list, param: str, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=4)
    assert needle in e.value.body["message"] and e.value.body["param"] == param, e.value.body


def test_valid_tool_history_and_neutral_values_are_accepted(client: openai.OpenAI) -> None:
    history = [*MSG, {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # (the fake engine's 512-token context has no room for the tool prompt: tool_choice "none" leaves it out)
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[TOOL], tool_choice="none",
                                       max_tokens=3, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[TOOL], tool_choice="none", max_tokens=3,
                                       response_format={"type": "text"}, temperature=0)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"guided_json": {"type": "integer", "minimum": "zero"}}}, "guided_json"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"tools": [TOOL]}}, "tools"),
])
def test_completions_400(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, **kwargs)
    assert param in e.value.body["message"], e.value.body
