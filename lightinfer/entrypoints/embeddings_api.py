"""OpenAI's Embeddings API, ``POST /v1/embeddings``, for pooling (embedding) models.

Request and response as OpenAI's (``client.embeddings.create``): ``input`` a string, a list of strings, a
list of token ids or a list of token-id lists (at most :data:`MAX_INPUTS` items); ``encoding_format``
"float" (lists of numbers) or "base64" (each vector's little-endian float32 bytes, what the official client
asks for by default and decodes); ``dimensions`` (Matryoshka truncation, then normalised again:
``lightinfer/inputs/pooling.py``); ``user`` (a label, changes nothing)::

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64..."}],
     "model": "...", "usage": {"prompt_tokens": N, "total_tokens": N}}

Each input is one engine request, batched with the others (the route submits them all, then waits); a
client that disconnects first aborts them. Every bad request is a 400 in OpenAI's error shape naming the
field (``input``, ``dimensions``, ``encoding_format``, ``model``), before any work: a generative model
("start it with --runner pooling"), an empty input or item, an item longer than the context (code
``context_length_exceeded``), token ids outside the vocabulary.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lightinfer.engine.async_engine import AsyncLLMEngine, RequestStream
from lightinfer.entrypoints.openai_errors import OpenAIError, as_openai_error
from lightinfer.entrypoints.served_models import ServedModels
from lightinfer.inputs import EngineRequest, InputProcessor, PoolingParams, check_text
from lightinfer.outputs import EmbeddingRequestOutput

logger = logging.getLogger(__name__)
MAX_INPUTS = 2048  # OpenAI's limit on the items of one request
_INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (unknown fields are a 400 naming them, as OpenAI answers)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"what to embed: {_INPUT_SHAPES} (at most {MAX_INPUTS} items)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, description="keep the first N values, normalised again "
                                                            "(Matryoshka); default: the model's size")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        """A clear message for each wrong shape (pydantic's would list every member of the union)."""
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            check_text(value, "input")
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be {_INPUT_SHAPES}, got a JSON {_json_kind(value)}")  # noqa: TRY004 - see below
        if not value:
            raise ValueError("must not be empty: give at least one string or token id")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"has {len(value)} items; at most {MAX_INPUTS} in one request")
        if all(_is_id(v) for v in value):
            return value
        for i, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input[{i}] is an empty string")
                check_text(item, f"input[{i}]")
            elif isinstance(item, list):
                if not item:
                    raise ValueError(f"input[{i}] is an empty list of token ids")
                if not all(_is_id(t) for t in item):
                    raise ValueError(f"input[{i}] must be a list of token ids (integers)")
            else:
                raise ValueError(  # noqa: TRY004 - pydantic turns a ValueError into the 400 naming the field
                    f"input[{i}] is a JSON {_json_kind(item)}; input must be {_INPUT_SHAPES}")
        if len({isinstance(item, str) for item in value}) > 1:
            raise ValueError("input mixes strings and token-id lists; send one kind per request")
        return value


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_kind(value: Any) -> str:
    return {dict: "object", bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(
        type(value), "null" if value is None else type(value).__name__)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _items(value: str | list[Any]) -> list[str | list[int]]:
    """The request's ``input`` as a list of prompts (one string or one id list is one prompt)."""
    if isinstance(value, str) or (value and _is_id(value[0])):
        return [value]  # type: ignore[list-item]
    return list(value)


def prepare_embeddings(inputs: InputProcessor, items: list[str | list[int]],
                       dimensions: int | None) -> list[EngineRequest]:
    """One engine request per item, tokenized and checked (on the serving's preparation thread: ``inputs`` is its
    processor).

    Raises:
        OpenAIError: 400 naming ``input`` (``input[i]`` in the message), ``dimensions`` or ``model``.
    """
    params = PoolingParams(dimensions=dimensions)
    requests = []
    for i, item in enumerate(items):
        try:
            requests.append(inputs.process_embedding(item, params, param="input"))
        except ValueError as exc:
            err = as_openai_error(exc)
            if len(items) > 1 and err.body.error.param == "input":
                err = OpenAIError(400, f"input[{i}]: {exc}", param="input", code=err.body.error.code)
            raise err from exc
    return requests


async def _collect(raw: Request, subs: list[tuple[str, RequestStream]],
                   engine: AsyncLLMEngine) -> list[EmbeddingRequestOutput] | None:
    """Every request's final output, in order; None when the client disconnected first (its requests aborted)."""

    async def finals() -> list[EmbeddingRequestOutput]:
        results = []
        for _, stream in subs:
            last = None
            async for out in stream:
                last = out
            if not isinstance(last, EmbeddingRequestOutput) or not last.finished:
                raise OpenAIError(500, "an embedding request ended without its vector", "server_error")
            results.append(last)
        return results

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(finals()), asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        for rid, _ in subs:
            engine.abort(rid)
        task.cancel()
        logger.info("client disconnected; aborted %d embedding request(s)", len(subs))
        return None
    finally:
        watcher.cancel()


def _encode(out: EmbeddingRequestOutput, encoding_format: str) -> list[float] | str:
    data = out.outputs.data
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(data.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return data.tolist()


def register_embeddings_routes(app: FastAPI, models: ServedModels) -> None:
    """Add ``POST /embeddings`` to the ``/v1`` app (``create_openai_app``), over the served ``models``."""

    @app.post("/embeddings", response_model=EmbeddingResponse)
    async def create_embeddings(req: EmbeddingRequest, raw: Request) -> Any:
        """OpenAI's Embeddings: one vector per input (string, token ids, or a list of either), pooled as the model
        says (sentence-transformers files, else the last token, L2-normalised); ``dimensions`` cuts it
        (Matryoshka) and normalises it again; ``encoding_format`` "float" or "base64". Embedding models only
        (served with ``--runner pooling``, or detected): other models answer 400."""
        items = _items(req.input)
        async with models.use(req.model) as serving:
            inputs = serving.inputs
            try:
                inputs.check_embeds()
                for item in items:  # costs nothing: a text far beyond the context never reaches the tokenizer
                    if isinstance(item, str):
                        inputs.check_text_size(len(item), "input")
                if req.dimensions is not None and inputs.pooler_config is not None:
                    inputs.pooler_config.output_dimensions(req.dimensions)
            except ValueError as exc:
                raise as_openai_error(exc) from exc
            # tokenizing on the serving's preparation thread, where its processor lives (openai_serving.py)
            requests = await serving.off_loop(prepare_embeddings, inputs, items, req.dimensions)
            subs = await serving.submit(requests)
        logger.info("embedding request %s: %d input(s), %d tokens", subs[0][0], len(requests),
                    sum(len(r.prompt_token_ids) for r in requests))
        outs = await _collect(raw, subs, serving.engine)
        if outs is None:
            return Response(status_code=499)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=_encode(o, req.encoding_format)) for i, o in enumerate(outs)],
            model=req.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
