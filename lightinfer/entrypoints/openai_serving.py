"""Requests of the OpenAI-compatible API -> engine requests, and token ids -> OpenAI's logprobs.

Prompts are prepared (chat template, tokenizing, checks: :mod:`lightinfer.inputs`) on one worker
thread with its own copy of the tokenizer, so a big request never blocks the event loop that
streams everyone's tokens; a text far beyond the context is refused on the loop before that, by its
length in characters (``InputProcessor.check_text_size``), so it never queues behind or holds the
tokenizer; the event loop keeps another copy for turning sampled ids into
token strings. HF fast tokenizers are not safe to share between threads, hence the two copies.
Structured-output constraints and tool grammars are compiled on that thread too (into the engine's
shared grammar cache), so the engine thread only copies a compiled matcher.

:func:`run_until_disconnect` is how every API route answers a request that is not streamed: a client that
disconnects first aborts its engine requests, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from lightinfer.engine.async_engine import AsyncLLMEngine, RequestStream
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_errors import OpenAIError, as_openai_error
from lightinfer.entrypoints.openai_structured import structured_error, structured_outputs_of
from lightinfer.inputs import EngineRequest, InputError
from lightinfer.inputs.text import check_text
from lightinfer.inputs.tools import ToolCalling
from lightinfer.outputs import CompletionOutput
from lightinfer.sampling_params import SamplingParams
from lightinfer.structured.spec import StructuredOutputs, StructuredOutputsError

T = TypeVar("T")
logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # of every API's event streams


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


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API logprobs.

    Args:
        engine: the shared async engine.
        served_model_name: the ``model`` the API answers to.
        tool_call_parser: the tool-call format (``--tool-call-parser``: hermes, llama3_json, mistral or an
            alias); None: detected from the chat template.
    Raises:
        ValueError: the engine has no tokenizer (text in, text out needs one); an unknown tool_call_parser.
    """

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        if engine.tokenizer is None:  # text in, text out: a tokenizer-less (dummy) engine cannot serve
            raise ValueError("serving needs a tokenizer; this model has none (dummy weights from a bare config "
                             "folder, or skip_tokenizer_init): add the tokenizer files to the folder")
        # used on the preparation thread only
        self.inputs = engine.input_processor.copy(tool_call_parser=tool_call_parser)
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # used on the event loop only
        self.max_model_len = self.inputs.max_model_len
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightinfer-inputs")  # the preparation thread

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the preparation thread; its exceptions come back here."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    # ------------------------------------------------------------------ request -> engine
    def check_model(self, model: str) -> None:
        """Raise 404 unless ``model`` is the served model (400 when it is not even Unicode text)."""
        try:
            check_text(model, "model")
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="model") from None
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.model_name}`", param="model", code="model_not_found")

    def sampling_params(self, req: P._SamplingRequest, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, prompt_param: str = "messages",
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        """Build and validate ``SamplingParams``; 400 when prompt + max_tokens exceed the context (naming
        ``prompt_param``, the request field that holds the prompt)."""
        try:
            room = self.inputs.check_context(prompt_len, max_tokens, prompt_param)
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                seed=req.seed, max_tokens=max_tokens or room, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                structured_outputs=structured)
        except ValueError as exc:
            raise as_openai_error(exc) from exc

    def _render_chat(self, req: P.ChatCompletionRequest) -> tuple[Any, ToolCalling | None]:
        messages = [m.to_message() for m in req.messages]
        try:
            return self.inputs.render_chat_tools(
                messages, tools=req.tools, tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls is not False,
                add_generation_prompt=req.add_generation_prompt, chat_template_kwargs=req.chat_template_kwargs)
        except InputError as exc:
            raise as_openai_error(exc) from exc
        except ValueError as exc:  # e.g. a model without a chat template
            raise OpenAIError(400, str(exc), param="messages") from exc

    def _chat_request(self, req: P.ChatCompletionRequest, top: int | None,
                      fit_context: bool = False) -> tuple[EngineRequest, ToolCalling | None]:
        structured, field = structured_outputs_of(req)  # cheap checks first: a bad schema is a 400 before any template
        prompt, calling = self._render_chat(req)
        if calling is not None:
            try:
                calling.check_compatible(structured)  # before the context check: the request itself is wrong
            except InputError as exc:
                raise as_openai_error(exc) from exc
        max_tokens = req.max_completion_tokens or req.max_tokens
        room = self.max_model_len - len(prompt.prompt_token_ids)
        if fit_context and max_tokens is not None and room > 0:
            max_tokens = min(max_tokens, room)
        params = self.sampling_params(req, len(prompt.prompt_token_ids), max_tokens, top, structured=structured)
        if calling is not None:
            try:
                params = calling.constrain(params)
            except InputError as exc:
                raise as_openai_error(exc) from exc
            field = "tools"
        return self._process(prompt, params, field), calling

    async def prepare_chat(self, req: P.ChatCompletionRequest, top: int | None, *,
                           fit_context: bool = False) -> tuple[EngineRequest, ToolCalling | None]:
        """The chat's engine request (template, tokens, settings, constraint), prepared off the event loop after
        a check that costs nothing (a conversation far beyond the context never reaches the tokenizer), and how
        to read tool calls from the reply (None without tools). ``fit_context``: a ``max_tokens`` beyond the
        room the prompt leaves is lowered to that room (Anthropic's rule) instead of a 400 (OpenAI's).

        Raises:
            OpenAIError: 400 naming the field (a template that refuses the messages, a prompt longer than
                the context, a bad setting, schema, regex, grammar, tool or tool_choice, a tool message
                answering no earlier call).
        """
        try:
            self.inputs.check_text_size(sum(len(m.text()) for m in req.messages), "messages")
        except ValueError as exc:
            raise as_openai_error(exc) from exc
        return await self.off_loop(self._chat_request, req, top, fit_context)

    async def count_chat_tokens(self, req: P.ChatCompletionRequest) -> int:
        """The prompt tokens :meth:`prepare_chat` would make of ``req`` (template, tools and the tool prompt
        included), counted off the event loop; nothing is submitted and ``max_tokens`` is not checked.

        Raises:
            OpenAIError: 400 naming the field (see :meth:`prepare_chat`), also for a conversation so long in
                characters that it cannot fit the context whatever its tokens (it is never tokenized).
        """
        try:
            self.inputs.check_text_size(sum(len(m.text()) for m in req.messages), "messages")
        except ValueError as exc:
            raise as_openai_error(exc) from exc
        prompt, _ = await self.off_loop(self._render_chat, req)
        return len(prompt.prompt_token_ids)

    def _completion_requests(self, req: P.CompletionRequest) -> tuple[list[EngineRequest], list[str]]:
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items or any(not item for item in items):
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        structured, field = structured_outputs_of(req)
        try:
            prompts = [self.inputs.tokenize(item) for item in items]
        except ValueError as exc:
            raise as_openai_error(exc) from exc
        params = self.sampling_params(req, max(len(t.prompt_token_ids) for t in prompts), req.max_tokens,
                                      req.logprobs, "prompt", structured=structured)
        requests = [self._process(t, params, field) for t in prompts]
        echo = [self.inputs.tokenizer.decode(t.prompt_token_ids) if req.echo else "" for t in prompts]
        return requests, echo

    async def prepare_completion(self, req: P.CompletionRequest) -> tuple[list[EngineRequest], list[str]]:
        """One engine request per prompt of ``prompt`` (a string, strings, ids or lists of ids), and the
        text each response starts with (the prompt when ``echo``), prepared off the event loop.

        Raises:
            OpenAIError: 400 naming the field.
        """
        p = req.prompt
        try:  # costs nothing: a text far beyond the context never reaches the tokenizer
            for item in [p] if isinstance(p, str) else p if isinstance(p, list) else []:
                if isinstance(item, str):
                    self.inputs.check_text_size(len(item), "prompt")
        except ValueError as exc:
            raise as_openai_error(exc) from exc
        return await self.off_loop(self._completion_requests, req)

    def _process(self, prompt: Any, params: SamplingParams, structured_field: str | None = None) -> EngineRequest:
        try:
            return self.inputs.process(prompt, params)  # compiles the constraint (into the engine's cache)
        except StructuredOutputsError as exc:  # the model's tokenizer cannot take it
            raise structured_error(exc, structured_field) from exc
        except ValueError as exc:
            raise as_openai_error(exc) from exc

    async def submit(self, requests: list[EngineRequest]) -> list[tuple[str, RequestStream]]:
        """Submit every request; if one is refused, abort the ones already accepted and raise."""
        accepted: list[tuple[str, RequestStream]] = []
        try:
            for request in requests:
                rid = self.engine.new_request_id("api")
                accepted.append((rid, await self.engine.add_request(rid, request)))
        except BaseException as exc:  # noqa: BLE001 -- cancellation too: abort what was accepted
            for rid, _ in accepted:
                self.engine.abort(rid)
            raise as_openai_error(exc) if isinstance(exc, Exception) else exc
        return accepted

    # ------------------------------------------------------------------ engine -> response
    def token_str(self, token_id: int) -> str:
        """The text of one token (event loop only)."""
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, comp: CompletionOutput, start: int, top: int) -> P.ChatLogprobs | None:
        """OpenAI chat ``logprobs.content`` for tokens ``start:`` of ``comp``."""
        if comp.logprobs is None:
            return None
        items = []
        for tid, lps in zip(comp.token_ids[start:], comp.logprobs[start:]):
            ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
            tok = self.token_str(tid)
            items.append(P.ChatTokenLogprob(
                token=tok, logprob=lps.get(tid, -math.inf), bytes=list(tok.encode()),
                top_logprobs=[P.TopLogprob(token=(t := self.token_str(i)), logprob=v, bytes=list(t.encode()))
                              for i, v in ranked]))
        return P.ChatLogprobs(content=items)

    def completion_logprobs(self, comp: CompletionOutput, start: int, top: int,
                            offset: int) -> P.CompletionLogprobs | None:
        """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
        if comp.logprobs is None:
            return None
        out = P.CompletionLogprobs()
        for tid, lps in zip(comp.token_ids[start:], comp.logprobs[start:]):
            tok = self.token_str(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(lps.get(tid, -math.inf))
            out.top_logprobs.append({self.token_str(i): v for i, v in sorted(lps.items(), key=lambda kv: -kv[1])[:top]})
            out.text_offset.append(offset)
            offset += len(tok)
        return out
