"""The Anthropic Messages API on the ``/v1`` app: ``POST /messages`` and ``POST /messages/count_tokens``, so
that Anthropic's clients (the ``anthropic`` SDKs, Claude Code) work against lightinfer.

A Messages request is turned into the equivalent Chat Completions request (:func:`to_chat_request`: the system
prompt and text blocks as messages, ``tool_use`` blocks as assistant ``tool_calls``, ``tool_result`` blocks as
``tool`` messages, ``tools`` / ``tool_choice`` / ``stop_sequences`` / sampling under OpenAI's names) and goes
through the same :class:`OpenAIServing` as ``/chat/completions``: one chat template, one tool grammar and
parser (:class:`lightinfer.inputs.tools.ToolCalling`), one way to sampling parameters. Only the two ends are
Anthropic's: the request schema (:mod:`anthropic_protocol`) and the reply, a message of ``text`` and
``tool_use`` blocks or Anthropic's event stream (``message_start``, ``ping``, per block ``content_block_start``
/ ``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``, ``message_delta``,
``message_stop``; an ``error`` event when a step fails).

A ``max_tokens`` beyond what the context leaves after the prompt is lowered to fit, as Anthropic does; a reply
that then reaches the context's end stops with ``model_context_window_exceeded``. Errors on these paths, the
request's validation included, come out in Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``, :func:`anthropic_error`): the ``/v1`` app's handlers are wrapped to reshape their answer on
these paths only, so the OpenAI routes keep OpenAI's. A client that disconnects aborts its engine request.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightinfer.entrypoints import anthropic_protocol as A
from lightinfer.entrypoints import openai_responses as R
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_errors import OpenAIError, as_openai_error
from lightinfer.entrypoints.openai_serving import SSE_HEADERS, OpenAIServing, run_until_disconnect
from lightinfer.entrypoints.served_models import ServedModels
from lightinfer.inputs.tools import ToolCalling
from lightinfer.outputs import CompletionOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of one message (or of the system prompt)
ERROR_PREFIX = "Error: "  # leads the text of a tool_result with is_error


# ---------------------------------------------------------------------------- request -> chat request
def _text_of(blocks: list[Any]) -> str:
    return BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, A.TextBlock))


def to_chat_request(req: A.CountTokensRequest) -> P.ChatCompletionRequest:
    """The Chat Completions request equivalent to a Messages (or count_tokens) request.

    ``system`` leads as a system message; a user message's ``tool_result`` blocks become ``tool`` messages
    (``is_error`` results start with "Error: ") and its text blocks one user message; an assistant message's
    ``tool_use`` blocks become its ``tool_calls``. Text blocks of one message are joined by a blank line.

    Raises:
        OpenAIError: 400 naming the field: a ``tool_result`` whose ``tool_use_id`` matches no earlier
            ``tool_use``; a conversation ending with an assistant message (a prefill, not supported).
    """
    messages: list[P.ChatMessage] = []
    system = req.system_text()
    if system is not None:
        messages.append(P.ChatMessage(role="system", content=system))
    calls: list[str] = []  # tool_use ids so far
    for i, m in enumerate(req.messages):
        blocks = [A.TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            if i == len(req.messages) - 1:
                raise OpenAIError(400, f"messages.{i}: the conversation ends with an assistant message (a prefill "
                                       "for the reply to continue), which lightinfer does not support; end it with "
                                       "a user message", param=f"messages.{i}")
            uses = [b for b in blocks if isinstance(b, A.ToolUseBlock)]
            calls += [b.id for b in uses]
            text = _text_of(blocks)
            messages.append(P.ChatMessage(
                role="assistant", content=text if text or not uses else None,
                tool_calls=[P.ToolCall(id=b.id, function=P.FunctionCall(
                    name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))) for b in uses] or None))
            continue
        texts: list[A.TextBlock] = []
        results = 0
        for j, b in enumerate(blocks):
            if isinstance(b, A.ToolResultBlock):
                if b.tool_use_id not in calls:
                    known = ", ".join(repr(c) for c in calls) or "none"
                    where = f"messages.{i}.content.{j}.tool_use_id"
                    raise OpenAIError(400, f"{where}: {b.tool_use_id!r} matches no tool_use block of an earlier "
                                           f"assistant message (known ids: {known})", param=where)
                if texts:  # text before a result stays before it
                    messages.append(P.ChatMessage(role="user", content=_text_of(texts)))
                    texts = []
                messages.append(P.ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                              content=(ERROR_PREFIX if b.is_error else "") + b.text()))
                results += 1
            elif isinstance(b, A.TextBlock):
                texts.append(b)
        if texts or not results:
            messages.append(P.ChatMessage(role="user", content=_text_of(texts)))
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []]
    choice = req.tool_choice
    openai_choice: Any = None
    if choice is not None:
        openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    fmt = req.output_config.format if req.output_config else None
    try:
        chat = P.ChatCompletionRequest(
            model=req.model, messages=messages, max_tokens=req.max_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, stream=req.stream, tools=tools or None, tool_choice=openai_choice,
            parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
            response_format=None if fmt is None else {"type": "json_schema",
                                                      "json_schema": {"name": "output", "schema": fmt.schema_}})
    except ValidationError as exc:  # not expected: the fields were checked as Anthropic's
        raise OpenAIError(400, f"the request could not be read: {exc.errors()[0].get('msg')}") from None
    chat.stop = req.stop_sequences or None  # assigned: Anthropic has no limit of 4 stop sequences, OpenAI has
    return chat


# the input layer names OpenAI's fields; the same fields under Anthropic's names
_FIELD_NAMES = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
                (re.compile(r"tools\[(\d+)\]\.function\.(\w+)"), r"tools.\1.\2"),
                (re.compile(r"tools\[(\d+)\](\.function)?"), r"tools.\1"),
                (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
                (re.compile(r"response_format\.json_schema\.schema|response_format"), "output_config.format.schema"),
                (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
                (re.compile(r'tool_choice: "required"'), 'tool_choice: {"type": "any"}')]


def _anthropic_names(text: str | None) -> str | None:
    if text is None:
        return None
    for pattern, name in _FIELD_NAMES:
        text = pattern.sub(name, text)
    return text


async def _in_anthropic_names(work: Awaitable[T]) -> T:
    """``await work``, its 400s naming the fields as Anthropic does (``tools.0.input_schema``)."""
    try:
        return await work
    except OpenAIError as exc:
        e = exc.body.error
        raise OpenAIError(exc.status, _anthropic_names(e.message) or "", e.type, _anthropic_names(e.param),
                          e.code) from None


# ---------------------------------------------------------------------------- engine -> message
def stop_reason(c: CompletionOutput, max_tokens: int | None, has_calls: bool) -> tuple[A.StopReason, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished completion: "max_tokens" (or
    "model_context_window_exceeded" when the context ended it first), "tool_use" after calls, "stop_sequence"
    with the sequence met, else "end_turn"."""
    if c.finish_reason == "length":
        short = max_tokens is not None and len(c.token_ids) < max_tokens
        return ("model_context_window_exceeded" if short else "max_tokens"), None
    if has_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments) if arguments.strip() else {}
    return value if isinstance(value, dict) else {"value": value}  # the tool grammar writes objects


async def message_full(serving: OpenAIServing, req: A.MessagesRequest, subs: R.Submitted,
                       calling: ToolCalling | None, message_id: str) -> A.MessagesResponse:
    """The whole message once the completion finished: its text, then one ``tool_use`` block per call.

    Raises:
        OpenAIError: a failed step (500), an engine that went away or aborted the request (503).
    """
    final = (await R.collect(subs))[0]
    c = final.outputs[0]
    text, calls = c.text, []
    if calling is not None:
        parsed = calling.parse(c.text)
        text, calls = parsed.content or "", parsed.tool_calls
    content: list[A.TextContent | A.ToolUseContent] = [A.TextContent(text=text)] if text else []
    content += [A.ToolUseContent(id=A.anthropic_id("toolu"), name=t.name, input=_tool_input(t.arguments))
                for t in calls]
    reason, sequence = stop_reason(c, req.max_tokens, bool(calls))
    return A.MessagesResponse(id=message_id, model=serving.model_name, content=content, stop_reason=reason,
                              stop_sequence=sequence,
                              usage=A.Usage(input_tokens=len(final.prompt_token_ids), output_tokens=len(c.token_ids)))


class _Blocks:
    """The stream's content blocks: opens, fills and closes them as pieces of the reply arrive."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def _open(self, block: A.TextContent | A.ToolUseContent) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, block.type
        return [*events, A.sse_event(A.ContentBlockStartEvent(index=self.index, content_block=block))]

    def close(self) -> list[str]:
        """The open block's ``content_block_stop`` (none when no block is open)."""
        if self.kind is None:
            return []
        self.kind = None
        return [A.sse_event(A.ContentBlockStopEvent(index=self.index))]

    def piece(self, piece: dict[str, Any]) -> list[str]:
        """The events of one piece of the reply: ``{"content": text}``, or an OpenAI ``tool_calls`` delta (a
        call's first one has its ``id`` and ``function.name``; ``function.arguments`` comes in pieces)."""
        if "content" in piece:
            if not piece["content"]:
                return []
            events = [] if self.kind == "text" else self._open(A.TextContent(text=""))
            return [*events, A.sse_event(A.ContentBlockDeltaEvent(index=self.index,
                                                                  delta=A.TextDelta(text=piece["content"])))]
        events = []
        for call in piece.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                events += self._open(A.ToolUseContent(id=A.anthropic_id("toolu"), name=fn.get("name") or "",
                                                      input={}))
            if fn.get("arguments") and self.kind == "tool_use":
                events.append(A.sse_event(A.ContentBlockDeltaEvent(
                    index=self.index, delta=A.InputJsonDelta(partial_json=fn["arguments"]))))
        return events


def _error_event(exc: Exception) -> str:
    status, body = anthropic_error(as_openai_error(exc))
    logger.warning("Messages stream ended with an error (%d): %s", status, body.error.message)
    return A.sse_event(body)


async def message_stream(serving: OpenAIServing, req: A.MessagesRequest, subs: R.Submitted,
                         calling: ToolCalling | None, message_id: str, prompt_tokens: int) -> AsyncIterator[str]:
    """The message as Anthropic's server-sent events (module docstring); the engine request is aborted if the
    stream ends early (the client went away) or fails."""
    parser = calling.stream_parser() if calling is not None else None
    blocks, shown, finished, last = _Blocks(), "", False, None
    try:
        yield A.sse_event(A.MessageStartEvent(message=A.MessagesResponse(
            id=message_id, model=serving.model_name, content=[],
            usage=A.Usage(input_tokens=prompt_tokens, output_tokens=0))))
        yield A.sse_event(A.PingEvent())
        async for _, out in R.merge_streams([s for _, s in subs]):
            last, c = out, out.outputs[0]
            delta, shown = c.text[len(shown):], c.text
            if parser is not None:
                pieces = parser.feed(delta) if delta else []
                if c.finished:
                    pieces += parser.finish()
            else:
                pieces = [{"content": delta}]
            for piece in pieces:
                for event in blocks.piece(piece):
                    yield event
        if last is None or not last.finished:
            raise OpenAIError(503, "the request was aborted by the server", "server_error", code="aborted")
        finished = True
        c = last.outputs[0]
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(c, req.max_tokens, parser is not None and bool(parser.tool_calls))
        yield A.sse_event(A.MessageDeltaEvent(delta=A.MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                              usage=A.Usage(input_tokens=prompt_tokens,
                                                            output_tokens=len(c.token_ids))))
        yield A.sse_event(A.MessageStopEvent())
    except Exception as exc:  # noqa: BLE001 -- a failed step: tell this client, keep the server up
        yield _error_event(exc)
    finally:
        if not finished:
            for rid, _ in subs:
                serving.engine.abort(rid)


# ---------------------------------------------------------------------------- errors
def anthropic_error(err: OpenAIError) -> tuple[int, A.ErrorResponse]:
    """The HTTP status and Anthropic body of an API error: 400 ``invalid_request_error``, 401
    ``authentication_error``, 404 ``not_found_error``, an overloaded engine 529 ``overloaded_error`` (Anthropic's
    status), other 5xx ``api_error``; the message as it was."""
    status = 529 if err.body.error.type == "server_overloaded" else err.status
    kind = A.ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, A.ErrorResponse(error=A.ErrorInfo(type=kind, message=err.body.error.message))


def is_messages_path(request: Request) -> bool:
    """Whether ``request`` is for ``/messages`` or a path under it (relative to where the app is mounted)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path == "/messages" or path.startswith("/messages/")


Handler = Callable[[Request, Exception], Awaitable[Response]]


def _reshaped_on_messages_paths(handler: Handler) -> Handler:
    async def dispatch(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        if not is_messages_path(request):
            return response
        try:
            e = json.loads(bytes(response.body))["error"]
            err = OpenAIError(response.status_code, e["message"], e.get("type") or "", e.get("param"), e.get("code"))
        except (ValueError, KeyError, TypeError):  # not an OpenAI error body: said as it was
            err = OpenAIError(response.status_code, bytes(response.body).decode("utf-8", "replace"))
        unknown = re.match(r"Unrecognized request arguments? supplied: (.+)$", err.body.error.message)
        if unknown:  # Anthropic's own words for a field it does not know
            err = OpenAIError(err.status, "; ".join(f"{name}: Extra inputs are not permitted"
                                                    for name in unknown.group(1).split(", ")), param=err.body.error.param)
        status, body = anthropic_error(err)
        reshaped = JSONResponse(body.model_dump(), status_code=status)
        if "allow" in response.headers:  # a 405 says which methods the route takes
            reshaped.headers["Allow"] = response.headers["allow"]
        return reshaped

    return dispatch


# ---------------------------------------------------------------------------- routes
def register_anthropic_routes(app: FastAPI, models: ServedModels) -> None:
    """Add ``POST /messages`` and ``POST /messages/count_tokens`` to ``app`` (the ``/v1`` app), and have its
    error handlers answer in Anthropic's shape on those paths. Call it after the app's own exception handlers
    are registered (``create_openai_app`` does); the app's API-key check applies (``x-api-key`` or Bearer)."""
    for exc_class in (OpenAIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(exc_class, _reshaped_on_messages_paths(app.exception_handlers[exc_class]))

    @app.post("/messages", response_model=None)
    async def messages(req: A.MessagesRequest, raw: Request) -> Response | A.MessagesResponse:
        """Anthropic's Messages API: ``system``, ``messages`` (text, ``tool_use`` and ``tool_result`` blocks),
        ``max_tokens``, ``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k``, ``tools`` and ``tool_choice``,
        ``stream`` (Anthropic's events). Images, documents and extended thinking: 400."""
        async with models.use(req.model) as serving:
            request, calling = await _in_anthropic_names(
                serving.prepare_chat(to_chat_request(req), None, fit_context=True))
            subs = await serving.submit([request])
        prompt_tokens = len(request.prompt_token_ids)
        message_id = A.anthropic_id("msg")
        logger.info("messages request %s: %d prompt tokens, stream=%s", subs[0][0], prompt_tokens, req.stream)
        if req.stream:
            return StreamingResponse(message_stream(serving, req, subs, calling, message_id, prompt_tokens),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnect(raw, message_full(serving, req, subs, calling, message_id),
                                          [r for r, _ in subs], serving.engine)

    @app.post("/messages/count_tokens", response_model=A.CountTokensResponse)
    async def count_tokens(req: A.CountTokensRequest) -> A.CountTokensResponse:
        """The prompt tokens a Messages request with this body would take (system prompt, tools and the chat
        template included): ``{"input_tokens": N}``. Nothing is generated."""
        async with models.use(req.model) as serving:
            count = await _in_anthropic_names(serving.count_chat_tokens(to_chat_request(req)))
        return A.CountTokensResponse(input_tokens=count)
