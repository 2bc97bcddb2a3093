"""Every error status of the API, in OpenAI's error JSON, through the official client (fake engine)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import LiveServer, fake_engine, start_server, wait_idle

from lightinfer.entrypoints.server import build_api_app
from lightinfer.webui.server import build_app

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(fake_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="test-key", max_retries=0)


def test_happy_path_on_fake(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == "The capital "
    assert r.usage.completion_tokens == 12
    parts = [p.choices[0].text for p in client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                                       stream=True)]
    assert "".join(parts) == "The ca"
    # any signed 64-bit seed, as OpenAI takes it; beyond that a 400 naming the field
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, seed=-5).choices
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, seed=2**63)


def test_streamed_deltas_carry_only_their_fields(fake_server: LiveServer) -> None:
    """As OpenAI streams them: the role once, then {"content": ...} pieces (or {}); no nulls for the fields a piece
    does not have."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, "temperature": 0, "stream": True}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": "Bearer test-key"})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len(deltas) > 2 and all(set(d) <= {"content"} for d in deltas[1:])
    whole = httpx.post(f"{fake_server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=30,
                       headers={"Authorization": "Bearer test-key"}).json()
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_401_wrong_or_missing_key(fake_server: LiveServer, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="nope", max_retries=0).models.list()


def test_404_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_404_unknown_path(fake_server: LiveServer) -> None:
    r = httpx.get(f"{fake_server.url}/v1/nothing", headers={"Authorization": "Bearer test-key"})
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
])
def test_400_bad_parameters(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, **kwargs)
    assert e.value.status_code == 400 and param in e.value.body["message"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "send tools instead"),
    ({"function_call": {"name": "f"}}, "send tool_choice instead"),
    ({"logit_bias": {"5": 10}}, "logit_bias is not supported"),
])
def test_400_unsupported(client: openai.OpenAI, kwargs: dict, needle: str) -> None:
    """Fields lightinfer does not implement are refused, not ignored."""
    kwargs = {"messages": MSG, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert needle in e.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, response_format={"type": "text"},
                                          tools=[], logit_bias={}).choices  # the neutral values are fine


@pytest.mark.parametrize("kwargs, needle", [
    ({"suffix": "tail"}, "suffix (insertion) is not supported"),
    ({"best_of": 3}, "best_of"),
])
def test_400_completions_unsupported(client: openai.OpenAI, kwargs: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **{"prompt": "x", **kwargs})
    assert needle in e.value.body["message"]


@pytest.mark.parametrize("path, field", [
    ("chat/completions", '"messages": [{"role": "user", "content": "a\\ud800b"}]'),
    ("chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]'),
    ("chat/completions", '"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud800"]'),
    ("completions", '"prompt": "a\\ud800b"'),
    ("completions", '"prompt": ["fine", "\\ud800"]'),
])
def test_400_lone_surrogate(fake_server: LiveServer, path: str, field: str) -> None:
    """A JSON \\u escape of a lone UTF-16 surrogate is valid JSON but not Unicode text: a 400 naming the field
    (it was a 500 from inside the tokenizer). The official client cannot even send one; curl can."""
    h = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
    body = '{"model": "' + MODEL + '", ' + field + "}"
    r = httpx.post(f"{fake_server.url}/v1/{path}", content=body.encode(), headers=h)
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["chat/completions", "completions", "models/a\\ud800"])
def test_lone_surrogate_in_the_model_field_is_a_400_not_a_500(fake_server: LiveServer, path: str) -> None:
    """Issue 19 item 7: the 404 message echoed the model name, and a lone surrogate in it made the error response
    itself fail to encode (500)."""
    h = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
    body = '{"model": "x\\ud800y", ' + ('"prompt": "hi"}' if path == "completions" else
                                         '"messages": [{"role": "user", "content": "hi"}]}')
    if path.startswith("models/"):
        r = httpx.get(f"{fake_server.url}/v1/models/x%ED%A0%80y", headers=h)  # the URL-encoded surrogate
        assert r.status_code in (400, 404), r.text
        return
    r = httpx.post(f"{fake_server.url}/v1/{path}", content=body.encode(), headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "model is not valid Unicode text" in r.json()["error"]["message"]


def test_error_messages_that_echo_input_are_always_encodable() -> None:
    from lightinfer.entrypoints.openai_errors import OpenAIError, error_response

    r = error_response(OpenAIError(404, "The model `a\ud800` does not exist"))
    assert r.status_code == 404 and b"a\\\\ud800" in r.body  # escaped, JSON-quoted


def test_400_body_not_an_object_or_not_finite(fake_server: LiveServer) -> None:
    h = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", content=b"[1, 2]", headers=h)
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}' % MODEL.encode()
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", content=body, headers=h)
    assert r.status_code == 400 and "finite number" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra", ['"max_tokens": true', '"stream": "yes"', '"temperature": "0.5"', '"n": 1.5',
                                   '"stream": true, "stream_options": {"include_usage": "yes"}'])
def test_400_wrong_json_types_are_not_coerced(fake_server: LiveServer, extra: str) -> None:
    """As OpenAI: true is not max_tokens=1 and "0.5" not a temperature (pydantic's lax mode took both)."""
    h = {"Authorization": "Bearer test-key", "Content-Type": "application/json"}
    body = '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}], ' + extra + "}"
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", content=body.encode(), headers=h)
    assert r.status_code == 400 and "Input should be a valid" in r.json()["error"]["message"], r.text
    ok = '{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}], "temperature": 1, "max_tokens": 2}'
    assert httpx.post(f"{fake_server.url}/v1/chat/completions", content=ok.encode(), headers=h).status_code == 200


def test_400_prompt_longer_than_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 600}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=10_000)
    assert e.value.body["param"] == "prompt"


def test_400_malformed_body(fake_server: LiveServer) -> None:
    h = {"Authorization": "Bearer test-key"}
    for body in ({"model": MODEL}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": None}]}):
        r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
        if body.get("messages") and body["messages"][0]["role"] == "user":
            assert "messages.0.content" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and "has no body" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{fake_server.url}/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"] and r.json()["error"]["param"] is None


def test_413_body_too_large(fake_server: LiveServer) -> None:
    r = httpx.post(f"{fake_server.url}/v1/completions", headers={"Authorization": "Bearer test-key"},
                   json={"model": MODEL, "prompt": "x" * 100_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_503_when_overloaded() -> None:
    engine = fake_engine(step_delay=0.02, max_waiting=2, max_num_seqs=1)
    live = start_server(build_api_app(engine), engine)
    try:
        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=f"{live.url}/v1", timeout=60) as c:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0}
                rs = await asyncio.gather(*[c.post("/completions", json=body) for _ in range(10)])
                for r in rs:
                    if r.status_code == 503:
                        assert r.json()["error"]["code"] == "overloaded"
                return [r.status_code for r in rs]

        codes = asyncio.run(main())
        assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
        with pytest.raises(openai.InternalServerError):  # the client maps 503 so (no retries here)
            async def flood() -> None:
                cl = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
                await asyncio.gather(*[cl.completions.create(model=MODEL, prompt="x", max_tokens=20)
                                       for _ in range(10)])
            asyncio.run(flood())
        assert "lightinfer_requests_rejected_total" in httpx.get(f"{live.url}/metrics").text
        wait_idle(live.url)
    finally:
        live.stop()


def test_failed_step_is_an_error_event_and_server_lives(client: openai.OpenAI, fake_server: LiveServer) -> None:
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "FAIL_STEP"}])
    with pytest.raises(openai.APIError, match="simulated kernel failure"):
        for _ in client.chat.completions.create(model=MODEL, stream=True,
                                                messages=[{"role": "user", "content": "FAIL_STEP"}]):
            pass
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, temperature=0) \
        .choices[0].message.content == "The"
    assert httpx.get(f"{fake_server.url}/health").status_code == 200


def test_ui_auth_guards_the_ui() -> None:
    engine = fake_engine()
    live = start_server(build_app(engine, ui_auth=("alice", "s3cret")), engine)
    try:
        assert httpx.get(f"{live.url}/config").status_code == 401
        r = httpx.post(f"{live.url}/login", data={"username": "alice", "password": "bad"})
        assert r.status_code in (400, 401)
        with httpx.Client(base_url=live.url) as c:
            assert c.post("/login", data={"username": "alice", "password": "s3cret"}).status_code == 200
            assert c.get("/config").status_code == 200
        assert httpx.get(f"{live.url}/health").status_code == 200  # health stays open
    finally:
        live.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts(stream: bool) -> None:
    """The request would take 400 steps x 20 ms = 8 s; the client leaves after ~0.5 s."""
    engine = fake_engine(step_delay=0.02)
    live = start_server(build_api_app(engine), engine)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "temperature": 0, "stream": stream}
        with httpx.Client(base_url=live.url, timeout=httpx.Timeout(5, read=0.5)) as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i == 10:
                            break  # closing the response drops the connection
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body)
        stats = wait_idle(live.url, timeout=3)  # well before the 8 s the request would take
        assert stats["num_generation_tokens"] < 300
    finally:
        live.stop()


def test_400_json_without_content_type(fake_server: LiveServer) -> None:
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", headers={"Authorization": "Bearer test-key"},
                   content=('{"model": "' + MODEL + '", "messages": [{"role": "user", "content": "hi"}]}').encode())
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_an_image_part_is_one_clear_400(client: openai.OpenAI) -> None:
    """It got pydantic's union message (every branch that failed, 'Input should be a valid string; ...')."""
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msg)
    text = e.value.body["message"]
    assert "content part 0 is of type 'image_url'" in text and "valid string" not in text


def test_a_body_that_is_not_utf8_says_so(fake_server: LiveServer) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "caf\xe9"}]}'
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json", "Authorization": "Bearer test-key"})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- issue 44 item 5: no field is dropped
H = {"Authorization": "Bearer test-key"}


@pytest.mark.parametrize("path, base", [("chat/completions", {"messages": MSG}), ("completions", {"prompt": "x"})])
def test_unknown_fields_are_a_400_naming_them_as_openai_does(fake_server: LiveServer, path: str, base: dict) -> None:
    """`"max_token": 5, "temprature": 0` was a 200 with 95 tokens (both ignored); OpenAI answers 400 naming them."""
    body = {"model": MODEL, **base, "max_token": 5, "temprature": 0}
    r = httpx.post(f"{fake_server.url}/v1/{path}", json=body, headers=H, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == "Unrecognized request arguments supplied: max_token, temprature", err
    assert err["type"] == "invalid_request_error" and err["param"] == "max_token"
    r = httpx.post(f"{fake_server.url}/v1/{path}", json={**body, "temprature": None, "max_token": None}, headers=H)
    assert r.status_code == 400  # null is no excuse: the name is still unknown
    del body["temprature"]
    r = httpx.post(f"{fake_server.url}/v1/{path}", json=body, headers=H, timeout=30)
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: max_token"


def test_unknown_field_through_the_official_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: num_keep"):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"num_keep": 5})


def test_documented_fields_at_their_neutral_values_and_request_labels_are_accepted(client: openai.OpenAI) -> None:
    """OpenAI's request labels and vLLM's documented extras (set to what asks for nothing) are not 'unrecognized'."""
    vllm = {"top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 1, "ignore_eos": True,
            "skip_special_tokens": True, "stop_token_ids": [], "include_stop_str_in_output": False,
            "spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
            "chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False, "echo": False,
            "add_special_tokens": False, "priority": 0, "guided_decoding_backend": "auto", "best_of": 1,
            "return_tokens_as_token_ids": False, "logits_processors": None, "documents": None}
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=3, temperature=0, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", parallel_tool_calls=True, logit_bias={}, stop=["a", "b", "c", "d"], stream=False,
        extra_body={**vllm, "prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"]})
    assert r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, user="u1", stream=True,
                                  stream_options={"include_usage": True},
                                  extra_body={"add_special_tokens": True, "include_stop_str_in_output": False,
                                              "request_id": "mine-1", "top_k": -1})
    chunks = list(r)
    assert chunks[0].id == "cmpl-mine-1" and chunks[-1].usage.completion_tokens == 3


def test_request_id_names_the_response(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={"request_id": "abc"})
    assert r.id == "chatcmpl-abc"
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).id.startswith("chatcmpl-")


@pytest.mark.parametrize("extra, needle", [
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output is not supported"),
    ({"use_beam_search": True}, "beam search"),
    ({"echo": True}, "echo on chat completions is not supported"),
    ({"continue_final_message": True}, "continue_final_message is not supported"),
    ({"reasoning_effort": "low"}, "reasoning_effort is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities other than text"),
    ({"priority": 1}, "priority"),
    ({"best_of": 3}, "best_of"),
    ({"length_penalty": True}, "length_penalty"),  # not 1: a JSON true is no neutral value
])
def test_documented_but_not_implemented_is_a_400_saying_so(client: openai.OpenAI, extra: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body=extra)
    assert needle in e.value.body["message"] and e.value.body["param"] == next(iter(extra)), e.value.body


def test_completions_without_special_tokens_is_a_400_saying_so(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="add_special_tokens: false is not supported"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"add_special_tokens": False})


@pytest.mark.parametrize("path, base", [("chat/completions", {"messages": MSG}), ("completions", {"prompt": "x"})])
def test_more_than_four_stop_sequences_is_a_400_naming_stop(fake_server: LiveServer, path: str, base: dict) -> None:
    body = {"model": MODEL, **base, "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}
    r = httpx.post(f"{fake_server.url}/v1/{path}", json=body, headers=H, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert "at most 4 stop sequences" in r.json()["error"]["message"]
    r = httpx.post(f"{fake_server.url}/v1/{path}", json={**body, "stop": ["a", "b", "c", "d"]}, headers=H, timeout=30)
    assert r.status_code == 200, r.text


def test_stream_options_need_stream(fake_server: LiveServer) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, headers=H, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_a_reply_without_tool_calls_has_no_tool_calls_field(fake_server: LiveServer) -> None:
    """OpenAI leaves `tool_calls` out of a message that called no tool; it was `"tool_calls": []`."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 3, "temperature": 0}
    message = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body, headers=H,
                         timeout=30).json()["choices"][0]["message"]
    assert set(message) == {"role", "content"}, message
