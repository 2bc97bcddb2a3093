"""The API prepares prompts (chat template, tokens, checks) on a worker thread, and the engine thread gets
them ready to run (fake engine)."""

from __future__ import annotations

import threading

import openai
import pytest
from conftest import fake_engine, start_server
from serving_fakes import FakeLLMEngine, FakeTokenizer

from lightinfer.entrypoints.server import build_api_app
from lightinfer.inputs import EngineRequest


def test_prompts_are_prepared_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads, received = set(), []
    render = FakeTokenizer.apply_chat_template
    monkeypatch.setattr(FakeTokenizer, "apply_chat_template",
                        lambda self, *a, **k: threads.add(threading.current_thread().name) or render(self, *a, **k))
    add = FakeLLMEngine.add_request
    monkeypatch.setattr(FakeLLMEngine, "add_request",
                        lambda self, rid, prompt, *a: received.append(prompt) or add(self, rid, prompt, *a))
    engine = fake_engine()
    live = start_server(build_api_app(engine), engine)
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, temperature=0)
        assert r.choices[0].message.content == "The" and r.usage.prompt_tokens == len(received[0].prompt_token_ids)
        client.completions.create(model="fake-model", prompt=["a", "b"], max_tokens=2)
    finally:
        live.stop()
    assert threads == {"lightinfer-inputs_0"}  # not the event loop's thread
    assert len(received) == 3 and all(isinstance(p, EngineRequest) for p in received)
    assert received[0].prompt.endswith("<|im_start|>assistant\n") and received[1].prompt == "a"
