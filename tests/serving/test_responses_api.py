"""OpenAI's Responses API (``POST /v1/responses``) against a live server on a scripted fake engine, with the
official ``openai`` client: plain and item input, instructions, function tools, ``text.format``, streaming (raw
events checked against the client's own models, and the ``responses.stream`` helper), incomplete replies,
errors naming the field, and aborts on disconnect.

The fake engine does not decode under a constraint; it replies what constrained decoding would let a model
reply (a tool call under a tool grammar, a JSON object under a JSON schema). That the constraint and the prompt
are the ones Chat Completions makes of the same request is checked by comparing the engine requests of both.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import LiveServer, start_server, wait_idle
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from serving_fakes import IM_END, FakeLLMEngine

from lightinfer.config import EngineConfig
from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.server import build_api_app
from lightinfer.inputs import EngineRequest

MODEL = "fake-model"
ANSWER = "The capital of France is Paris."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
PREAMBLE = "Let me look that up."
JSON_REPLY = '{"city": "Oslo", "temperature": 21}'
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": PARAMS,
        "strict": True}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}
EVENTS = TypeAdapter(ResponseStreamEvent)


class ScriptedEngine(FakeLLMEngine):
    """The fake engine, replying as a constrained model would: under a tool grammar a call (after a preamble when
    the prompt says "Think aloud"), under a JSON schema :data:`JSON_REPLY`, greedy :data:`ANSWER` (then the end);
    sampled replies are random letters until ``max_tokens``. Keeps every engine request it gets."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.received: list[EngineRequest] = []

    def add_request(self, request_id: str, prompt: Any, sampling_params: Any = None) -> None:
        if isinstance(prompt, EngineRequest):
            self.received.append(prompt)
        super().add_request(request_id, prompt, sampling_params)

    def _advance(self, req: Any, comp: Any) -> None:
        so = req.params.structured_outputs
        if so is None and not req.params.greedy:
            return super()._advance(req, comp)
        reply = ANSWER if so is None else JSON_REPLY if so.json is not None or so.json_object else \
            (PREAMBLE + "\n" if "Think aloud" in req.prompt else "") + CALL
        n = len(comp.token_ids)
        comp.token_ids.append(ord(reply[n]) if n < len(reply) else IM_END)
        self.stats.num_generation_tokens += 1
        comp.text = self.tokenizer.decode(comp.token_ids)
        if len(comp.token_ids) >= len(reply):
            comp.finish_reason = "stop"
        elif len(comp.token_ids) >= req.params.max_tokens:
            comp.finish_reason = "length"
        return None


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    config = EngineConfig(model="fake", device="cpu", max_model_len=4096, max_waiting=64)
    engine = AsyncLLMEngine(ScriptedEngine(config))
    server = start_server(build_api_app(engine), engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)


def _received(live: LiveServer) -> EngineRequest:
    return live.engine.engine.received[-1]  # type: ignore[attr-defined]


def _same_request(got: EngineRequest, want: EngineRequest) -> None:
    """The two engine requests are the same: prompt, settings and constraint."""
    assert got.prompt == want.prompt and got.prompt_token_ids == want.prompt_token_ids
    g, w = got.sampling_params, want.sampling_params
    assert (g.structured_outputs is None) == (w.structured_outputs is None)
    if g.structured_outputs is not None:
        assert g.structured_outputs.key == w.structured_outputs.key
    assert dataclasses.replace(g, structured_outputs=None) == dataclasses.replace(w, structured_outputs=None)


def _raw(live: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)


def _events(live: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events, each checked against the official client's event models (and its
    ``event:`` line against its ``type``)."""
    events = []
    with httpx.stream("POST", f"{live.url}/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                EVENTS.validate_python(data)
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_string_input(live: LiveServer, client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model=MODEL, input="What is the capital of France?",
                                                    temperature=0, metadata={"k": "v"}, store=True, user="u")
    r = Response.model_validate(raw.http_response.json())  # every field the client's model requires, validated
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == ANSWER and r.model == MODEL
    assert r.output[0].type == "message" and r.output[0].status == "completed"
    assert r.store is False and r.metadata == {"k": "v"} and r.temperature == 0 and r.tool_choice == "auto"
    got = _received(live)
    assert r.usage.input_tokens == len(got.prompt_token_ids) and r.usage.output_tokens == len(ANSWER)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                   temperature=0)
    _same_request(got, _received(live))


def test_instructions_and_items_make_the_chat_prompt(live: LiveServer, client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions="Be brief.", temperature=0, tools=[TOOL], input=[
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},  # ignored
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'},
        {"role": "user", "content": "And tomorrow?"}])
    got = _received(live)
    client.chat.completions.create(model=MODEL, temperature=0, tools=[CHAT_TOOL], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        {"role": "user", "content": "And tomorrow?"}])
    _same_request(got, _received(live))
    assert "Be brief." in got.prompt and "<tool_response>" in got.prompt and "get_weather" in got.prompt
    assert [o.type for o in r.output] == ["function_call"]  # tool_choice auto: the tool grammar constrains


def test_forced_function_tool(live: LiveServer, client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[TOOL],
                                tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    got = _received(live)
    assert r.status == "completed" and len(r.output) == 1 and r.output_text == ""
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and json.loads(call.arguments) == {"city": "Oslo"}
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    assert r.parallel_tool_calls is False
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                   tools=[CHAT_TOOL], parallel_tool_calls=False,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _same_request(got, _received(live))  # the same tool grammar as Chat Completions'


class City(BaseModel):
    city: str
    temperature: int


def test_text_format_json_schema(live: LiveServer, client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Weather in Oslo as JSON", text_format=City)
    assert r.output_parsed == City(city="Oslo", temperature=21)
    got = _received(live)
    fmt = r.text.format
    assert fmt.type == "json_schema" and fmt.name == "City" and fmt.strict is True
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo as JSON"}],
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "City", "schema": fmt.schema_, "strict": True}})
    _same_request(got, _received(live))  # the same constrained decoding as response_format's
    r = client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}})
    assert json.loads(r.output_text) == {"city": "Oslo", "temperature": 21}


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="hi", temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == ANSWER[:5] and r.output[0].status == "incomplete" and r.max_output_tokens == 5


def test_stream_events(live: LiveServer) -> None:
    events = _events(live, {"input": "hi", "temperature": 0})
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2] if "item_id" in e)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == ANSWER and final.usage.output_tokens == len(ANSWER)
    assert final.id == events[0]["response"]["id"]
    # cut short: response.incomplete, the message item incomplete
    events = _events(live, {"input": "hi", "temperature": 0, "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete" and events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_create_with_text_and_a_call(live: LiveServer, client: openai.OpenAI) -> None:
    """``create(stream=True)``: the preamble as a message item, then the call's item with argument deltas."""
    stream = client.responses.create(model=MODEL, input="Think aloud: weather in Oslo?", tools=[TOOL], stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert items == [(0, "message"), (1, "function_call")]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == PREAMBLE and json.loads(args) == {"city": "Oslo"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and done.name == "get_weather" and done.output_index == 1
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == PREAMBLE


def test_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="hi", temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == ANSWER and final.output_text == ANSWER and final.status == "completed"
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[TOOL], tool_choice="required") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = final.output[0]
    assert call.type == "function_call" and call.parsed_arguments == {"city": "Oslo"}  # strict tool: parsed


BAD = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' tools are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1].type", "'input_image' content is not supported"),
    ({"max_tokens": 5}, "max_tokens", "Unrecognized request argument supplied: max_tokens"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice.name",
     "'get_time' is not in tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "'file_search' is not supported"),
    ({"tools": [CHAT_TOOL]}, "tools[0].name", "not nested under \"function\""),
    ({"tools": [{**TOOL, "parameters": {"type": "objekt"}}]}, "tools[0].parameters", "not a valid JSON Schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "is required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format.schema",
     "not a valid JSON Schema"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "21"}]}, "input[0].call_id",
     "matches no tool call"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{oops"}]}, "input[1].arguments", "not valid JSON"),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0].type", "'computer_call' items"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "does not store responses"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": " "}, "input", "must not be empty"),
    ({"input": 5}, "input", "valid string"),  # named by the field, not by pydantic's union member (input.str)
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "cannot be included"),
    ({"conversation": "conv_1"}, "conversation", "send the whole conversation in `input`"),
    ({"max_output_tokens": 5000}, "input", "or lower max_output_tokens"),
    ({"input": "x" * 200_000}, "input", "'input' holds"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[p for _, p, _ in BAD])
def test_bad_requests_are_400s_naming_the_field(live: LiveServer, body: dict[str, Any], param: str,
                                                message: str) -> None:
    r = _raw(live, {"input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_client_raises_a_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not store responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")


def test_nothing_is_stored_and_unknown_models_are_404s(live: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not store responses") as exc:
        client.responses.retrieve("resp_123")
    assert exc.value.body["param"] == "response_id"
    assert httpx.delete(f"{live.url}/v1/responses/resp_123", timeout=10).status_code == 404
    r = _raw(live, {"model": "gpt-4o", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_failed_step_is_an_error_event(live: LiveServer) -> None:
    events = _events(live, {"input": "FAIL_STEP", "temperature": 0})
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "simulated kernel failure" in events[2]["message"]
    assert events[3]["response"]["status"] == "failed" and events[3]["response"]["error"]["code"] == "server_error"


def test_a_client_that_disconnects_aborts_its_request(live: LiveServer) -> None:
    body = {"model": MODEL, "input": "tell me a long story", "temperature": 1, "max_output_tokens": 3000}
    start = time.monotonic()
    with httpx.stream("POST", f"{live.url}/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # and close the connection
    wait_idle(live.url, timeout=5)  # 3000 steps would take 6 s or more
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/responses", json=body, timeout=0.5)
    wait_idle(live.url, timeout=5)
    assert time.monotonic() - start < 10
