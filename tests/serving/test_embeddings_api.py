"""``POST /v1/embeddings`` with the official ``openai`` client against a live server of a tiny Qwen3 embedding model
(float and base64, ``dimensions``, token ids), and every bad request a 400 in OpenAI's shape naming the field."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import LiveServer, fake_engine, start_server, wait_idle

from lightinfer.config import EngineConfig
from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.server import build_api_app
from tests.fixtures.embedding_models import reference_embedding, tiny_qwen3_model, write_embedding_checkpoint

MODEL = "emb"
ATOL = 2e-5


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return tiny_qwen3_model()


@pytest.fixture(scope="module")
def emb_server(tmp_path_factory: pytest.TempPathFactory, hf_model: torch.nn.Module) -> Iterator[LiveServer]:
    path = write_embedding_checkpoint(tmp_path_factory.mktemp("emb-api") / "qwen3-emb", hf_model)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=256,
                          max_num_batched_tokens=32, kv_cache_memory_bytes="4MiB")
    engine = AsyncLLMEngine.from_config(config, show_progress=False)  # as `lightinfer serve` loads it
    live = start_server(build_api_app(engine, served_model_name=MODEL), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(emb_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{emb_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ids_of(emb_server: LiveServer):
    """The served model's tokenizer (byte-level: one id per byte, no special tokens added)."""
    tokenizer = emb_server.engine.tokenizer
    return lambda text: list(tokenizer.encode(text, add_special_tokens=True))


def test_float_and_base64_match_transformers(client: openai.OpenAI, hf_model: torch.nn.Module,
                                             emb_server: LiveServer, ids_of) -> None:
    texts = ["hello world", "a much longer input, prefilled in chunks of 32 tokens by this server", "x"]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    tokens = sum(len(ids_of(t)) for t in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    for text, d in zip(texts, floats.data):
        want = reference_embedding(hf_model, ids_of(text))
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=ATOL, rtol=0)
    # Another request may be batched and chunked differently (the engine is not batch-invariant): the same vector
    # within float32 rounding, where a wrong dtype or byte order in the base64 would be nowhere near it.
    b64 = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    for f, b in zip(floats.data, b64.data):
        assert b.embedding == pytest.approx(f.embedding, abs=1e-6)
    raw = httpx.post(f"{emb_server.url}/v1/embeddings", json={"model": MODEL, "input": "x",
                                                              "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == pytest.approx(floats.data[2].embedding, abs=1e-6)
    assert wait_idle(emb_server.url)["num_free_blocks"] > 0  # every KV block free again


def test_token_ids_and_dimensions(client: openai.OpenAI, hf_model: torch.nn.Module, ids_of) -> None:
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [9]], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(many.data[0].embedding, abs=ATOL)
    assert many.usage.prompt_tokens == 4
    torch.testing.assert_close(torch.tensor(many.data[1].embedding), reference_embedding(hf_model, [9]),
                               atol=ATOL, rtol=0)
    cut = client.embeddings.create(model=MODEL, input="hello", dimensions=16, encoding_format="float")
    assert len(cut.data[0].embedding) == 16
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding),
                               reference_embedding(hf_model, ids_of("hello"), dimensions=16), atol=ATOL, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", ""]}, "input", "input[1] is an empty string"),
    ({"input": [[1, 2], []]}, "input", "input[1] is an empty list"),
    ({"input": ["a", [1]]}, "input", "mixes strings and token-id lists"),
    ({"input": {"text": "a"}}, "input", "got a JSON object"),
    ({"input": [1, 999]}, "input", "outside the vocabulary"),
    ({"input": ["fits", "y" * 300]}, "input", "input[1]: 'input' has 300 tokens"),
    ({"input": "z" * 300}, "input", "maximum context length is 256"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "dimensions": 65}, "dimensions", "between 1 and 64"),
    ({"input": "a", "dimensions": "8"}, "dimensions", "valid integer"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "a", "truncate": True}, "truncate", "Unrecognized request argument"),
])
def test_bad_requests_are_400_naming_the_field(emb_server: LiveServer, body: dict, param: str, words: str) -> None:
    r = httpx.post(f"{emb_server.url}/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_too_long_is_context_length_exceeded(client: openai.OpenAI, emb_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input="w" * 257)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "input"
    wait_idle(emb_server.url)


def test_generation_refused_and_models_unchanged(client: openai.OpenAI, emb_server: LiveServer) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.BadRequestError, match="this model serves embeddings: use /v1/embeddings"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="this model serves embeddings: use /v1/embeddings"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_generative_model_refuses_embeddings() -> None:
    engine = fake_engine()
    live = start_server(build_api_app(engine, served_model_name="gen"), engine)
    try:
        r = httpx.post(f"{live.url}/v1/embeddings", json={"model": "gen", "input": "hi"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "--runner pooling" in err["message"]
    finally:
        live.stop()
