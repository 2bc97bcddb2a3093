"""Route handlers of the OpenAI-compatible API (see ``openai_api.py`` for errors, auth and helpers).

Streaming responses are server-sent events: one ``chat.completion.chunk`` (or ``text_completion``)
per engine step that produced text, an optional usage chunk, then ``data: [DONE]``. A stream
that leaves early (client gone: Starlette cancels the generator) aborts its engine requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from lightinfer.engine.async_engine import RequestStream
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_api import (
    OpenAIError,
    OpenAIServing,
    _as_openai_error,
    merge_streams,
    run_until_disconnect,
)
from lightinfer.outputs import RequestOutput

logger = logging.getLogger(__name__)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(finals: dict[int, RequestOutput]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _collect(subs: list[tuple[str, RequestStream]]) -> dict[int, RequestOutput]:
    """Read every stream to its end; the last output of each prompt, by prompt index."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_streams([s for _, s in subs]):
            finals[i] = out
    except Exception as exc:
        raise _as_openai_error(exc) from exc
    if len(finals) < len(subs) or not all(o.finished for o in finals.values()):
        raise OpenAIError(503, "the request was aborted by the server", "server_error", code="aborted")
    return finals


def _error_event(exc: Exception) -> str:
    err = _as_openai_error(exc)
    logger.warning("stream ended with an error: %s", err.body.error.message)
    return P.sse(err.body)


def register_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add the ``/models``, ``/chat/completions`` and ``/completions`` routes to ``app``."""
    engine = serving.engine

    @app.get("/models", response_model=P.ModelList)
    async def list_models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=serving.model_name, max_model_len=serving.max_model_len)])

    @app.get("/models/{model_id:path}", response_model=P.ModelCard)
    async def get_model(model_id: str) -> P.ModelCard:
        serving.check_model(model_id)
        return P.ModelCard(id=serving.model_name, max_model_len=serving.max_model_len)

    @app.post("/chat/completions", response_model=None)
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request) -> Response:
        serving.check_model(req.model)
        ids = serving.chat_prompt(req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = serving.sampling_params(req, len(ids), req.max_completion_tokens or req.max_tokens, top)
        subs = await serving.submit([ids], params)
        logger.info("chat request %s: %d prompt tokens, n=%d, stream=%s", subs[0][0], len(ids), req.n, req.stream)
        logger.debug("chat request %s messages: %r", subs[0][0], [(m.role, m.text()) for m in req.messages])
        if req.stream:
            return StreamingResponse(_chat_stream(req, subs, top), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return await run_until_disconnect(raw, _chat_full(req, subs, top), [r for r, _ in subs], engine)

    async def _chat_full(req: P.ChatCompletionRequest, subs: list[tuple[str, RequestStream]],
                         top: int | None) -> P.ChatCompletionResponse:
        final = (await _collect(subs))[0]
        choices = [P.ChatCompletionChoice(
            index=c.index, message=P.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
            logprobs=serving.chat_logprobs(c, 0, top) if top is not None else None) for c in final.outputs]
        return P.ChatCompletionResponse(model=serving.model_name, choices=choices, usage=_usage({0: final}))

    async def _chat_stream(req: P.ChatCompletionRequest, subs: list[tuple[str, RequestStream]],
                           top: int | None) -> AsyncIterator[str]:
        cid, created = P.random_id("chatcmpl"), int(time.time())

        def chunk(choices: list[P.ChatCompletionStreamChoice], usage: P.UsageInfo | None = None) -> str:
            return P.sse(P.ChatCompletionChunk(id=cid, created=created, model=serving.model_name,
                                               choices=choices, usage=usage))

        prev_text, prev_tok, done = [""] * req.n, [0] * req.n, [False] * req.n
        finished, last = False, None
        try:
            yield chunk([P.ChatCompletionStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                         for i in range(req.n)])
            async for _, out in merge_streams([s for _, s in subs]):
                last, choices = out, []
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    delta = c.text[len(prev_text[i]):]
                    lp = serving.chat_logprobs(c, prev_tok[i], top) if top is not None else None
                    if delta or c.finish_reason or (lp is not None and lp.content):
                        choices.append(P.ChatCompletionStreamChoice(
                            index=i, delta=P.DeltaMessage(content=delta), logprobs=lp,
                            finish_reason=c.finish_reason))
                    prev_text[i], prev_tok[i], done[i] = c.text, len(c.token_ids), c.finished
                if choices:
                    yield chunk(choices)
            finished = last is not None and last.finished
            if req.stream_options and req.stream_options.include_usage and last is not None:
                yield chunk([], _usage({0: last}))
        except Exception as exc:  # noqa: BLE001 -- a failed step: tell this client, keep the server up
            yield _error_event(exc)
        finally:
            if not finished:
                for rid, _ in subs:
                    engine.abort(rid)
        yield P.sse("[DONE]")

    @app.post("/completions", response_model=None)
    async def completions(req: P.CompletionRequest, raw: Request) -> Response:
        serving.check_model(req.model)
        prompts = serving.completion_prompts(req)
        top = req.logprobs
        params = serving.sampling_params(req, max(len(p) for p in prompts), req.max_tokens, top, "prompt")
        subs = await serving.submit(prompts, params)
        logger.info("completion request %s: %d prompt(s), n=%d, stream=%s", subs[0][0], len(prompts), req.n,
                    req.stream)
        logger.debug("completion request %s prompt: %r", subs[0][0], req.prompt)
        echo = [serving.tokenizer.decode(p) if req.echo else "" for p in prompts]
        if req.stream:
            return StreamingResponse(_completion_stream(req, subs, top, echo), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return await run_until_disconnect(raw, _completion_full(req, subs, top, echo), [r for r, _ in subs],
                                          engine)

    async def _completion_full(req: P.CompletionRequest, subs: list[tuple[str, RequestStream]],
                               top: int | None, echo: list[str]) -> P.CompletionResponse:
        finals = await _collect(subs)
        choices = [P.CompletionChoice(
            index=pi * req.n + c.index, text=echo[pi] + c.text, finish_reason=c.finish_reason,
            logprobs=serving.completion_logprobs(c, 0, top, len(echo[pi])) if top is not None else None)
            for pi in sorted(finals) for c in finals[pi].outputs]
        return P.CompletionResponse(model=serving.model_name, choices=choices, usage=_usage(finals))

    async def _completion_stream(req: P.CompletionRequest, subs: list[tuple[str, RequestStream]],
                                 top: int | None, echo: list[str]) -> AsyncIterator[str]:
        cid, created = P.random_id("cmpl"), int(time.time())
        prev_text: dict[int, str] = {}
        prev_tok: dict[int, int] = {}
        done: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        finished = False
        try:
            async for pi, out in merge_streams([s for _, s in subs]):
                finals[pi] = out
                choices = []
                for c in out.outputs:
                    idx = pi * req.n + c.index
                    if idx in done:
                        continue
                    first = idx not in prev_text
                    delta = (echo[pi] if first else "") + c.text[len(prev_text.get(idx, "")):]
                    lp = (serving.completion_logprobs(c, prev_tok.get(idx, 0), top, len(prev_text.get(idx, "")))
                          if top is not None else None)
                    if delta or c.finish_reason or (lp is not None and lp.tokens):
                        choices.append(P.CompletionChoice(index=idx, text=delta, logprobs=lp,
                                                          finish_reason=c.finish_reason))
                    prev_text[idx], prev_tok[idx] = c.text, len(c.token_ids)
                    if c.finished:
                        done.add(idx)
                if choices:
                    yield P.sse(P.CompletionResponse(id=cid, created=created, model=serving.model_name,
                                                     choices=choices))
            finished = len(finals) == len(subs) and all(o.finished for o in finals.values())
            if req.stream_options and req.stream_options.include_usage:
                yield P.sse(P.CompletionResponse(id=cid, created=created, model=serving.model_name, choices=[],
                                                 usage=_usage(finals)))
        except Exception as exc:  # noqa: BLE001 -- as above
            yield _error_event(exc)
        finally:
            if not finished:
                for rid, _ in subs:
                    engine.abort(rid)
        yield P.sse("[DONE]")

