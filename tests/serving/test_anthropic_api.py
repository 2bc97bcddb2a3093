"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) with the official ``anthropic``
client, on the fake engine (one server for the module): replies, Anthropic's event stream, tool use both ways,
stop sequences, token counts, ``x-api-key``, and errors in Anthropic's shape (the OpenAI routes keep OpenAI's)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from conftest import LiveServer, start_server
from serving_fakes import SCRIPT, FakeLLMEngine, FakeTokenizer

from lightinfer.config import EngineConfig
from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.anthropic_api import anthropic_error
from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.entrypoints.server import build_api_app
from lightinfer.inputs import EngineRequest

MODEL, KEY = "fake-model", "test-key"
AUTH = {"x-api-key": KEY}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
GREEDY = {"extra_body": {"temperature": 0}}  # the client (2.17) has no sampling arguments: they go in the body
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'  # hermes, the fallback


class ToolWritingEngine(FakeLLMEngine):
    """The fake engine, which also writes a call of get_weather where constrained decoding would make a model
    call a tool (a tool grammar and the tool prompt, and no tool result yet); it keeps the prompts it gets."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, step_delay=0.001)
        self.prompts: list[str] = []

    def add_request(self, request_id: str, prompt: Any, sampling_params: Any = None) -> None:
        if isinstance(prompt, EngineRequest):
            self.prompts.append(prompt.prompt)
        super().add_request(request_id, prompt, sampling_params)

    def _advance(self, req: Any, comp: Any) -> None:
        if req.params.structured_outputs is None or "<tools>" not in req.prompt or "<tool_response>" in req.prompt:
            return super()._advance(req, comp)
        n = len(comp.token_ids)
        comp.token_ids.append(ord(CALL[n]))
        comp.text = CALL[: n + 1]
        if n + 1 == len(CALL):
            comp.finish_reason = "stop"
        return None


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    fake = ToolWritingEngine(EngineConfig(model="fake", device="cpu", max_model_len=4096, max_waiting=64))
    engine = AsyncLLMEngine(fake)
    server = start_server(build_api_app(engine, api_key=KEY), engine)
    server.fake = fake  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    """Raw HTTP to the server, with its key as x-api-key (one kept-alive connection)."""
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=30) as c:
        yield c


def _prompt(live: LiveServer) -> str:
    return live.fake.prompts[-1]  # type: ignore[attr-defined]


def _events(r: httpx.Response) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each server-sent event of ``r``."""
    out = []
    for chunk in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def _stats(http: httpx.Client) -> dict:
    return http.get("/stats").json()  # x-api-key on a route outside /v1 too


def test_message_and_its_token_count(client: anthropic.Anthropic, live: LiveServer, http: httpx.Client) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in English."}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}]
    r = client.messages.create(model=MODEL, max_tokens=10, system=system, messages=messages,
                               metadata={"user_id": "u1"}, extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == SCRIPT[:10]
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 10
    assert "<|im_start|>system\nBe brief.\n\nAnswer in English.<|im_end|>" in _prompt(live)
    assert _prompt(live).endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")
    count = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert count.input_tokens == r.usage.input_tokens == len(FakeTokenizer().encode(_prompt(live)))
    # the same body, max_tokens and all, counts the same; tools add their prompt
    body = {"model": MODEL, "max_tokens": 10, "system": system, "messages": messages}
    same = http.post("/v1/messages/count_tokens", json=body)
    assert same.json() == {"input_tokens": count.input_tokens}
    with_tools = client.messages.count_tokens(model=MODEL, system=system, messages=messages, tools=[WEATHER])
    assert with_tools.input_tokens > count.input_tokens
    # a max_tokens beyond the context is lowered to fit it (Anthropic's rule), and said so when it ends the reply
    long = client.messages.create(model=MODEL, max_tokens=100_000, **GREEDY,
                                  messages=[{"role": "user", "content": "x" * 4000}])
    assert long.stop_reason == "model_context_window_exceeded" and 0 < long.usage.output_tokens < 100
    assert long.usage.input_tokens + long.usage.output_tokens == 4096


def test_stream_helper_text_and_final_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=20, **GREEDY, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SCRIPT[:20] == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20 and final.usage.input_tokens > 0


def test_raw_events_in_anthropic_order(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": ASK, "stream": True}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and all(d["type"] == name for name, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for _, d in events[3:-3]) == SCRIPT[:12]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 12


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    kwargs = {"model": MODEL, "max_tokens": 60, **GREEDY, "messages": ASK,
              "stop_sequences": ["Paris", "Rome", "Oslo", "Bern", "Kyiv"]}  # more than OpenAI's 4
    r = client.messages.create(**kwargs)
    assert r.content[0].text == "The capital of France is "
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text and (final.stop_reason, final.stop_sequence) == \
        ("stop_sequence", "Paris")


def test_tool_use_then_tool_result(client: anthropic.Anthropic, live: LiveServer) -> None:
    r = client.messages.create(model=MODEL, max_tokens=200, **GREEDY, messages=ASK, tools=[WEATHER, TIME],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert '"name": "get_weather"' in _prompt(live)  # the tool prompt (the fake template renders no tools)
    history = [*ASK, {"role": "assistant", "content": r.content}]
    r2 = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, tools=[WEATHER, TIME], messages=[
        *history, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C, sunny"}]},
            {"type": "text", "text": "Thanks!"}]}])
    assert r2.stop_reason == "max_tokens" and r2.content[0].text == SCRIPT[:8]
    prompt = _prompt(live)
    assert CALL in prompt and "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert prompt.index("</tool_response>") < prompt.index("Thanks!")
    client.messages.create(model=MODEL, max_tokens=2, tools=[WEATHER], messages=[
        *history, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                                "content": "city not found"}]}])
    assert "<tool_response>\nError: city not found\n</tool_response>" in _prompt(live)


def test_tool_use_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=200, **GREEDY, messages=ASK, tools=[WEATHER, TIME],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "get_weather" and final.content[0].input == {"city": "Paris"}
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1 and starts[0].content_block.type == "tool_use" and starts[0].content_block.input == {}
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert pieces and json.loads("".join(pieces)) == {"city": "Paris"}


def test_x_api_key_and_bearer_are_both_accepted(live: LiveServer, http: httpx.Client) -> None:
    bad = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=live.url, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).usage.output_tokens == 2
    assert http.get("/v1/models").status_code == 200  # OpenAI's routes too
    assert http.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert _stats(http)["num_total_blocks"] > 0


def _msg(**over: Any) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": ASK, **over}


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
BAD = [  # (body, words the message holds)
    ({"model": MODEL, "messages": ASK}, ["max_tokens", "Field required"]),
    (_msg(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
     ["messages.0.content", "block 0", "image blocks are not supported"]),
    (_msg(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "videoclip"}]}]),
     ["messages.0.content", "block 1", "'videoclip' is not a content block type"]),
    (_msg(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), ["document blocks"]),
    (_msg(messages=[{"role": "tool", "content": "x"}]), ["messages.0.role", "'user' or 'assistant'"]),
    (_msg(messages=[{"role": "system", "content": "x"}]), ["messages.0.role", "top-level \"system\" field"]),
    (_msg(messages=[{"role": "user", "content": [USE]}]), ["tool_use blocks do not belong in user content"]),
    (_msg(thinking={"type": "enabled", "budget_tokens": 2048}), ["thinking", "extended thinking", "not supported"]),
    (_msg(messages=[*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]},
                    *ASK]), ["thinking blocks are not supported"]),
    (_msg(max_tokenz=3), ["max_tokenz: Extra inputs are not permitted"]),
    (_msg(temperature=1.5), ["temperature", "less than or equal to 1"]),
    (_msg(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]),
     ["messages.0.content.0.tool_use_id", "matches no tool_use block"]),
    (_msg(messages=[*ASK, {"role": "assistant", "content": "The answer is"}]), ["messages.1", "prefill"]),
    (_msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]), ["tools.0", "server tools"]),
    (_msg(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_time"}), ["tool_choice.name", "not in tools"]),
    (_msg(tools=[WEATHER], tool_choice={"type": "tool"}), ["tool_choice", "needs the name"]),
    (_msg(tools=[{**WEATHER, "input_schema": {"type": "objekt"}}]), ["tools.0.input_schema", "JSON Schema"]),
    (_msg(output_config={"format": {"type": "json_schema", "schema": {"type": "objekt"}}}),
     ["output_config.format.schema"]),
    (_msg(container="c1"), ["container", "not supported"]),
    (_msg(messages=[{"role": "user", "content": ""}]), ["messages.0.content", "must not be empty"]),
    (_msg(messages=[{"role": "user", "content": []}]), ["messages.0.content", "must not be empty"]),
]


@pytest.mark.parametrize("body, words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_requests_are_400_in_anthropic_shape(http: httpx.Client, body: dict, words: list[str]) -> None:
    before = _stats(http)["num_prompt_tokens"]
    r = http.post("/v1/messages", json=body)
    got = r.json()
    assert r.status_code == 400 and set(got) == {"type", "error"} and got["type"] == "error", got
    assert set(got["error"]) == {"type", "message"} and got["error"]["type"] == "invalid_request_error", got
    assert all(w in got["error"]["message"] for w in words), got
    assert _stats(http)["num_prompt_tokens"] == before  # refused before anything ran


def test_other_errors_in_anthropic_shape(client: anthropic.Anthropic, http: httpx.Client) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "`fake-model`" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)
    r = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/messages", content=b"x" * (5 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"  # Anthropic's shape
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["type"] == "error"
    r = http.post("/v1/messages/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # a failed engine step: a 500 api_error, or an error event in the stream; the server carries on
    failing = [{"role": "user", "content": "FAIL_STEP"}]
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=failing)
    assert e.value.body["error"]["type"] == "api_error"
    r = http.post("/v1/messages", json=_msg(messages=failing, stream=True))
    last_name, last = _events(r)[-1]
    assert last_name == "error" and last["error"]["type"] == "api_error" and "simulated" in last["error"]["message"]
    with pytest.raises(anthropic.APIStatusError, match="simulated kernel failure"), \
            client.messages.stream(model=MODEL, max_tokens=4, messages=failing) as stream:
        stream.get_final_message()
    assert client.messages.create(model=MODEL, max_tokens=3, **GREEDY, messages=ASK).content[0].text == "The"


def test_error_types_and_statuses() -> None:
    """An overloaded engine (OpenAI's 503 server_overloaded) is Anthropic's 529 overloaded_error, which its clients
    retry; other statuses keep theirs, under Anthropic's names."""
    cases = [(OpenAIError(503, "busy", "server_overloaded", code="overloaded"), 529, "overloaded_error"),
             (OpenAIError(503, "engine unavailable", "server_error"), 503, "api_error"),
             (OpenAIError(401, "no key"), 401, "authentication_error"),
             (OpenAIError(405, "use POST"), 405, "invalid_request_error")]
    for err, status, kind in cases:
        got_status, body = anthropic_error(err)
        assert (got_status, body.model_dump()) == (status, {"type": "error", "error": {
            "type": kind, "message": err.body.error.message}})


def test_openai_routes_keep_openai_errors(live: LiveServer, http: httpx.Client) -> None:
    def openai_error(r: httpx.Response, status: int) -> dict:
        body = r.json()
        assert r.status_code == status and set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]

    url = "/v1/chat/completions"
    assert "messages" in openai_error(http.post(url, json={"model": MODEL}), 400)["message"]
    no_key = httpx.post(f"{live.url}{url}", json={"model": MODEL, "messages": ASK}, timeout=10)
    assert openai_error(no_key, 401)["code"] == "invalid_api_key"
    assert openai_error(http.post(url, json={"model": "x", "messages": ASK}), 404)["code"] == "model_not_found"
    assert "POST /v1/messages" in openai_error(http.get("/v1/nothing"), 404)["message"]


def _wait_idle(http: httpx.Client) -> dict:
    deadline = time.monotonic() + 5
    while True:
        stats = _stats(http)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if (idle and stats["num_free_blocks"] == stats["num_total_blocks"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_client_disconnect_aborts_the_request(live: LiveServer, http: httpx.Client) -> None:
    body = _msg(max_tokens=3000, temperature=0, stream=True)  # ~3 s of the fake's steps if not aborted
    for stream in (True, False):
        before = _stats(http)["num_generation_tokens"]
        if stream:
            with httpx.stream("POST", f"{live.url}/v1/messages", json=body, headers=AUTH, timeout=10) as r:
                for line in r.iter_lines():
                    if line == "event: content_block_delta":
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{live.url}/v1/messages", json={**body, "stream": False}, headers=AUTH, timeout=0.3)
        stats = _wait_idle(http)
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_generation_tokens"] - before < 2000, (stream, stats)
