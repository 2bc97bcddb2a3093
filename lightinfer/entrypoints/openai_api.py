"""The OpenAI-compatible API: ``/models``, ``/chat/completions``, ``/completions`` (mounted at ``/v1``).

A FastAPI sub-application, so its errors (validation included) come out in OpenAI's error JSON
without touching the Gradio app beside it:

    400 bad parameters / prompt longer than the context   401 missing or wrong API key
    404 unknown model or path                             503 overloaded (``max_waiting``) or engine down

Prompts are tokenized here (chat template included) with the front end's own copy of the
tokenizer: the engine thread uses the engine's copy, and HF fast tokenizers are not safe to
share between threads. A client that disconnects aborts its requests, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightinfer.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestStream,
)
from lightinfer.entrypoints import protocol as P
from lightinfer.outputs import CompletionOutput, RequestOutput
from lightinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error to send as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, P.ErrorResponse(error=P.ErrorInfo(
            message=message, type=type_, param=param, code=code))


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body.model_dump(), status_code=err.status)


def _as_openai_error(exc: Exception) -> OpenAIError:
    """Map engine exceptions to statuses: ValueError 400, overloaded/dead 503, failed step 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(503, str(exc), "server_overloaded", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"engine unavailable: {exc}", "server_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc))
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        if engine.tokenizer is None:  # text in, text out: a tokenizer-less (dummy) engine cannot serve
            raise ValueError("serving needs a tokenizer; this model has none (dummy weights from a bare config "
                             "folder, or skip_tokenizer_init): add the tokenizer files to the folder")
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = int(engine.model_info()["max_model_len"])

    # ------------------------------------------------------------------ request -> engine
    def check_model(self, model: str) -> None:
        """Raise 404 unless ``model`` is the served model."""
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.model_name}`", param="model", code="model_not_found")

    def sampling_params(self, req: P._SamplingRequest, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, prompt_param: str = "messages") -> SamplingParams:
        """Build and validate ``SamplingParams``; 400 when prompt + max_tokens exceed the context (naming
        ``prompt_param``, the request field that holds the prompt)."""
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = f"; you requested {prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt, " \
                    f"{max_tokens or 0} for the completion)"
            raise OpenAIError(400, f"This model's maximum context length is {self.max_model_len} tokens"
                                   f"{asked}. Shorten the prompt or lower max_tokens.",
                              param=prompt_param, code="context_length_exceeded")
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                seed=req.seed, max_tokens=max_tokens or room, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        """Apply the chat template; token ids of the prompt (400 if the template refuses)."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=False)
        except Exception as exc:  # jinja errors, e.g. roles the template does not allow
            raise OpenAIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_prompts(self, req: P.CompletionRequest) -> list[list[int]]:
        """The ``prompt`` field (str, list of str, ids, list of ids) as lists of token ids."""
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        out = []
        for item in items:
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError(400, "prompt must not be empty", param="prompt")
            out.append(ids)
        return out

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> list[tuple[str, RequestStream]]:
        """Submit every prompt; if one is refused, abort the ones already accepted and raise."""
        accepted: list[tuple[str, RequestStream]] = []
        try:
            for ids in prompts:
                rid = self.engine.new_request_id("api")
                accepted.append((rid, await self.engine.add_request(rid, ids, params)))
        except BaseException as exc:  # noqa: BLE001 -- cancellation too: abort what was accepted
            for rid, _ in accepted:
                self.engine.abort(rid)
            raise _as_openai_error(exc) if isinstance(exc, Exception) else exc
        return accepted

    # ------------------------------------------------------------------ engine -> response
    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, comp: CompletionOutput, start: int, top: int) -> P.ChatLogprobs | None:
        """OpenAI chat ``logprobs.content`` for tokens ``start:`` of ``comp``."""
        if comp.logprobs is None:
            return None
        items = []
        for tid, lps in zip(comp.token_ids[start:], comp.logprobs[start:]):
            ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
            tok = self._token_str(tid)
            items.append(P.ChatTokenLogprob(
                token=tok, logprob=lps.get(tid, -math.inf), bytes=list(tok.encode()),
                top_logprobs=[P.TopLogprob(token=(t := self._token_str(i)), logprob=v, bytes=list(t.encode()))
                              for i, v in ranked]))
        return P.ChatLogprobs(content=items)

    def completion_logprobs(self, comp: CompletionOutput, start: int, top: int,
                            offset: int) -> P.CompletionLogprobs | None:
        """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
        if comp.logprobs is None:
            return None
        out = P.CompletionLogprobs()
        for tid, lps in zip(comp.token_ids[start:], comp.logprobs[start:]):
            tok = self._token_str(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(lps.get(tid, -math.inf))
            out.top_logprobs.append({self._token_str(i): v for i, v in sorted(lps.items(), key=lambda kv: -kv[1])[:top]})
            out.text_offset.append(offset)
            offset += len(tok)
        return out


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as ``(prompt_index, output)`` in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
            await q.put((i, None))
        except Exception as exc:  # noqa: BLE001 -- re-raised in the reader
            await q.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def run_until_disconnect(request: Request, work: Any, request_ids: list[str],
                               engine: AsyncLLMEngine) -> Any:
    """Await ``work``; if the client disconnects first, abort ``request_ids`` and cancel it."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        for rid in request_ids:
            engine.abort(rid)
        task.cancel()
        logger.info("client disconnected; aborted %d request(s)", len(request_ids))
        return Response(status_code=499)
    finally:
        watcher.cancel()


def create_openai_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The ``/v1`` sub-application. ``api_key``: when set, every route needs ``Authorization: Bearer <key>``."""
    from lightinfer.entrypoints.openai_routes import register_routes  # routes live there (file size)

    async def verify_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise OpenAIError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")

    app = FastAPI(title="lightinfer OpenAI-compatible API", dependencies=[Depends(verify_key)],
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        raw = first.get("input")
        if isinstance(raw, (bytes, str)) and not loc:  # no JSON Content-Type: FastAPI left the body unparsed
            try:
                json.loads(raw)
            except ValueError as e:
                first = {"type": "json_invalid", "ctx": {"error": str(e)}}
            else:
                return _error_response(OpenAIError(400, "send the JSON body with Content-Type: application/json"))
        if first.get("type") == "json_invalid":  # the body itself, not one of its fields
            detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            return _error_response(OpenAIError(400, f"the request body is not valid JSON ({detail}); send a JSON "
                                                    "object with Content-Type: application/json"))
        if not loc:  # valid JSON, but not an object (a list, a number), or no body at all
            if raw is None:
                return _error_response(OpenAIError(400, "the request has no body; send a JSON object with "
                                                        "Content-Type: application/json"))
            kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(raw),
                                                                                                    type(raw).__name__)
            return _error_response(OpenAIError(400, f"the request body must be a JSON object, got a JSON {kind}"))
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: "
                        f"{str(e.get('msg', '')).removeprefix('Value error, ')}"  # pydantic's prefix to our checks
                        for e in exc.errors()[:5])
        return _error_response(OpenAIError(400, msg or "invalid request", param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind))

    register_routes(app, OpenAIServing(engine, served_model_name))
    return app

