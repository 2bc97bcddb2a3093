"""Engine outputs -> OpenAI responses: whole ones, and server-sent event streams.

A stream is one ``chat.completion.chunk`` (or ``text_completion``) per engine step that produced
text, an optional usage chunk, then ``data: [DONE]``. A stream that ends early (client gone:
Starlette cancels the generator) or fails aborts its engine requests.

With tools, each choice's text goes through a tool-call parser: the reply's ``content`` is the text
outside the calls, ``tool_calls`` the calls (OpenAI's shapes; streamed as ``delta.tool_calls`` pieces:
index, id and name first, then the arguments in pieces), and a reply that called tools finishes with
``finish_reason`` "tool_calls".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from lightinfer.engine.async_engine import RequestStream
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_errors import OpenAIError, as_openai_error
from lightinfer.entrypoints.openai_serving import OpenAIServing
from lightinfer.inputs.tools import ToolCalling
from lightinfer.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)
Submitted = list[tuple[str, RequestStream]]  # (request id, its stream) per prompt


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


def usage(finals: dict[int, RequestOutput]) -> P.UsageInfo:
    """Token counts over all prompts' outputs."""
    prompt = sum(len(o.prompt_token_ids) for o in finals.values())
    completion = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def collect(subs: Submitted) -> dict[int, RequestOutput]:
    """Read every stream to its end; the last output of each prompt, by prompt index."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_streams([s for _, s in subs]):
            finals[i] = out
    except Exception as exc:
        raise as_openai_error(exc) from exc
    if len(finals) < len(subs) or not all(o.finished for o in finals.values()):
        raise OpenAIError(503, "the request was aborted by the server", "server_error", code="aborted")
    return finals


def _error_event(exc: Exception) -> str:
    err = as_openai_error(exc)
    logger.warning("stream ended with an error: %s", err.body.error.message)
    return P.sse(err.body)


def _abort_all(serving: OpenAIServing, subs: Submitted) -> None:
    for rid, _ in subs:
        serving.engine.abort(rid)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a reply that ended normally after calling tools."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _chat_choice(serving: OpenAIServing, c: CompletionOutput, top: int | None,
                 calling: ToolCalling | None) -> P.ChatCompletionChoice:
    message = P.AssistantMessage(content=c.text)
    if calling is not None:
        parsed = calling.parse(c.text)
        message = P.AssistantMessage(content=parsed.content, tool_calls=[
            P.ToolCall(id=t.id, function=P.FunctionCall(name=t.name, arguments=t.arguments))
            for t in parsed.tool_calls] or None)  # no calls: no field, as OpenAI
    return P.ChatCompletionChoice(index=c.index, message=message,
                                  finish_reason=finish_reason(c.finish_reason, bool(message.tool_calls)),
                                  logprobs=serving.chat_logprobs(c, 0, top) if top is not None else None)


async def chat_full(serving: OpenAIServing, req: P.ChatCompletionRequest, subs: Submitted, top: int | None,
                    calling: ToolCalling | None = None) -> P.ChatCompletionResponse:
    """The whole chat completion, once every choice finished (tool calls parsed out when ``calling``)."""
    final = (await collect(subs))[0]
    choices = [_chat_choice(serving, c, top, calling) for c in final.outputs]
    return P.ChatCompletionResponse(id=req.response_id("chatcmpl"), model=serving.model_name, choices=choices,
                                    usage=usage({0: final}))


def _tool_deltas(parser: object, text: str, finished: bool) -> list[P.DeltaMessage]:
    """The parser's OpenAI deltas for new ``text`` (and its last ones when ``finished``)."""
    pieces = parser.feed(text) if text else []  # type: ignore[attr-defined]
    if finished:
        pieces += parser.finish()  # type: ignore[attr-defined]
    return [P.DeltaMessage(**piece) for piece in pieces]


async def chat_stream(serving: OpenAIServing, req: P.ChatCompletionRequest, subs: Submitted,
                      top: int | None, calling: ToolCalling | None = None) -> AsyncIterator[str]:
    """The chat completion as server-sent events: the role first, then text deltas per choice (content and
    tool-call pieces when ``calling``)."""
    cid, created = req.response_id("chatcmpl"), int(time.time())

    def chunk(choices: list[P.ChatCompletionStreamChoice], usage_info: P.UsageInfo | None = None) -> str:
        return P.sse(P.ChatCompletionChunk(id=cid, created=created, model=serving.model_name,
                                           choices=choices, usage=usage_info))

    prev_text, prev_tok, done = [""] * req.n, [0] * req.n, [False] * req.n
    parsers = [calling.stream_parser() for _ in range(req.n)] if calling is not None else None
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
                if parsers is not None:  # content and tool-call pieces, in order; the finish on the last
                    deltas = _tool_deltas(parsers[i], delta, c.finished)
                    reason = finish_reason(c.finish_reason, bool(parsers[i].tool_calls))
                    if not deltas and (reason or (lp is not None and lp.content)):
                        deltas = [P.DeltaMessage(content="")]
                    choices += [P.ChatCompletionStreamChoice(
                        index=i, delta=d, logprobs=lp if k == 0 else None,
                        finish_reason=reason if k == len(deltas) - 1 else None) for k, d in enumerate(deltas)]
                elif delta or c.finish_reason or (lp is not None and lp.content):
                    choices.append(P.ChatCompletionStreamChoice(
                        index=i, delta=P.DeltaMessage(content=delta), logprobs=lp,
                        finish_reason=c.finish_reason))
                prev_text[i], prev_tok[i], done[i] = c.text, len(c.token_ids), c.finished
            if parsers is None:
                if choices:
                    yield chunk(choices)
            else:
                for choice in choices:  # one piece per chunk: each choice's content and calls stay in order
                    yield chunk([choice])
        finished = last is not None and last.finished
        if req.stream_options and req.stream_options.include_usage and last is not None:
            yield chunk([], usage({0: last}))
    except Exception as exc:  # noqa: BLE001 -- a failed step: tell this client, keep the server up
        yield _error_event(exc)
    finally:
        if not finished:
            _abort_all(serving, subs)
    yield P.sse("[DONE]")


async def completion_full(serving: OpenAIServing, req: P.CompletionRequest, subs: Submitted, top: int | None,
                          echo: list[str]) -> P.CompletionResponse:
    """The whole text completion: ``n`` choices per prompt, prompt-major."""
    finals = await collect(subs)
    choices = [P.CompletionChoice(
        index=pi * req.n + c.index, text=echo[pi] + c.text, finish_reason=c.finish_reason,
        logprobs=serving.completion_logprobs(c, 0, top, len(echo[pi])) if top is not None else None)
        for pi in sorted(finals) for c in finals[pi].outputs]
    return P.CompletionResponse(id=req.response_id("cmpl"), model=serving.model_name, choices=choices,
                                usage=usage(finals))


async def completion_stream(serving: OpenAIServing, req: P.CompletionRequest, subs: Submitted, top: int | None,
                            echo: list[str]) -> AsyncIterator[str]:
    """The text completion as server-sent events (the echoed prompt leads each choice's first delta)."""
    cid, created = req.response_id("cmpl"), int(time.time())
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
                                             usage=usage(finals)))
    except Exception as exc:  # noqa: BLE001 -- as above
        yield _error_event(exc)
    finally:
        if not finished:
            _abort_all(serving, subs)
    yield P.sse("[DONE]")
