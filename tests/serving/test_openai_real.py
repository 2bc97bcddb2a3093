"""The official ``openai`` client against a live server running the real SmolLM2 (INT8 KV)."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import LiveServer, wait_idle

MODEL = "smollm2"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.usage.completion_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + \
        full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2  # token by token


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text


def test_n2_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=1.0, n=2, seed=7,
                                       logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) > 0 and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0 for t in content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    streamed = list(client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, n=2, seed=7,
                                                   temperature=1.0, stream=True))
    texts = ["".join(ch.delta.content or "" for c in streamed for ch in c.choices if ch.index == i)
             for i in range(2)]
    assert texts == [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def test_stop_strings(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    parts = list(client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=24, temperature=0,
                                                stop="Paris", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == r.choices[0].message.content


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=seed, extra_body={"top_k": 50}).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b and a != c


def test_penalties_and_extras_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_completion_tokens=6, temperature=0.5,
                                       top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                       extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens <= 6


def test_context_overflow_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1200}])


def test_metrics_after_traffic(real_server: LiveServer) -> None:
    wait_idle(real_server.url)
    text = httpx.get(f"{real_server.url}/metrics").text
    for name in ("lightinfer_time_to_first_token_seconds_bucket", "lightinfer_inter_token_latency_seconds_count",
                 "lightinfer_generation_tokens_total", "lightinfer_prompt_tokens_total",
                 "lightinfer_kv_cache_usage_ratio", "lightinfer_num_requests_running 0.0",
                 "lightinfer_prefix_cache_hit_rate", "lightinfer_num_preemptions_total"):
        assert name in text, name
