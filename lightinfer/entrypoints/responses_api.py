"""OpenAI's Responses API (``POST /v1/responses``) over the Chat Completions machinery.

A Responses request is converted into the equivalent :class:`~lightinfer.entrypoints.protocol.ChatCompletionRequest`
(:func:`to_chat_request`): ``instructions`` become a system message first, ``input`` items become chat
messages (``function_call`` items an assistant message's ``tool_calls``, ``function_call_output`` items
``tool`` messages), function ``tools`` and ``tool_choice`` take Chat Completions' nested shape and
``text.format`` becomes ``response_format``. That request then goes the way every chat request goes
(:meth:`OpenAIServing.prepare_chat`: the chat template, the input checks, sampling settings, constrained
decoding for ``text.format`` and tools, :class:`~lightinfer.inputs.tools.ToolCalling` to read calls back), so
nothing here templates, samples, constrains or parses tool calls itself. An error of that path names a chat
field (``messages[3].tool_call_id``); it is renamed to the Responses field the client sent (``input[4].call_id``).

The reply's text and calls (the tool-call parser's pieces) become output items: a ``message`` with one
``output_text`` part, and ``function_call`` items. With ``stream`` they go out as OpenAI's event sequence
(``response.created``, ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... ``response.completed``), each with its ``event:`` line and ``sequence_number``.

Stateless: nothing is stored (``store`` is accepted and the response says ``store: false``), so
``previous_response_id`` is a 400 and ``GET /v1/responses/{id}`` a 404, both saying to send the conversation in
``input``. A client that disconnects aborts its engine request, freeing its KV blocks.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from lightinfer.engine.async_engine import RequestStream
from lightinfer.entrypoints import openai_responses as R
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints import responses_protocol as RP
from lightinfer.entrypoints.openai_errors import OpenAIError, as_openai_error
from lightinfer.entrypoints.openai_serving import SSE_HEADERS, OpenAIServing, run_until_disconnect
from lightinfer.entrypoints.served_models import ServedModels
from lightinfer.inputs.tools import ToolCalling
from lightinfer.outputs import RequestOutput

logger = logging.getLogger(__name__)
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
NON_TEXT_PARTS = ("input_image", "input_file", "input_audio")
ITEM_KINDS = "message, function_call, function_call_output (and reasoning, which is ignored)"


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


# ---------------------------------------------------------------------------- request -> chat request
class ChatSources:
    """Where each message of the converted chat request came from, to name the Responses field in an error of
    the chat path (:meth:`rename`)."""

    def __init__(self) -> None:
        self.messages: list[str] = []  # chat message index -> "instructions", "input" or "input[j]"
        self.calls: dict[tuple[int, int], str] = {}  # (message index, tool_calls index) -> "input[j]"

    def _message_path(self, m: re.Match[str]) -> str:
        i = int(m.group(1))
        if i >= len(self.messages):
            return m.group(0)
        where, tail = self.messages[i], m.group(2) or ""
        call = re.match(r"\.tool_calls\[(\d+)\](.*)", tail)
        if call:
            base = self.calls.get((i, int(call.group(1))), where)
            rest = call.group(2)
            return base + (".arguments" if rest.endswith("arguments") else ".call_id" if rest == ".id"
                           else ".name" if rest.startswith(".function") else "")
        if tail == ".tool_call_id":
            return f"{where}.call_id"
        if tail == ".content":
            return where if where in ("instructions", "input") else f"{where}.content"
        return where

    def rename_text(self, text: str) -> str:
        """``text`` (an error message or a param) with the chat request's field names replaced by the
        Responses request's."""
        text = re.sub(r"\bmessages\[(\d+)\]((?:\.tool_calls\[\d+\](?:\.function)?(?:\.\w+)?)|\.tool_call_id"
                      r"|\.content)?", self._message_path, text)
        for pattern, repl in _RENAMES:
            text = pattern.sub(repl, text)
        return text

    def rename(self, err: OpenAIError) -> OpenAIError:
        """``err`` of the chat path, naming the Responses request's field (``input``, ``tools[0].parameters``,
        ``text.format.schema``, ``max_output_tokens``...) in its ``param`` and message."""
        e = err.body.error
        param = None if e.param is None else "input" if e.param in ("messages", "prompt") else self.rename_text(e.param)
        return OpenAIError(err.status, self.rename_text(e.message), e.type, param, e.code)


_RENAMES = [(re.compile(p), r) for p, r in (
    (r"'messages'", "'input'"),
    (r"\btools\[(\d+)\]\.function\b", r"tools[\1]"),
    (r"\btool_choice\.function\.name\b", "tool_choice.name"),
    (r"\bresponse_format\.json_schema\b", "text.format"),
    (r"\bresponse_format\b", "text.format"),
    (r"\bmax_completion_tokens\b|\bmax_tokens\b", "max_output_tokens"),
)]


def _text_parts(value: Any, at: str, what: str) -> str | list[dict[str, str]]:
    """A message's ``content`` (or an output's ``output``): a string, or its text parts as chat text parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(at, f"must be a string or a list of text parts ({what}), got {type(value).__name__}")
    parts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NON_TEXT_PARTS:
            raise _bad(f"{at}[{k}].type", f"{kind!r} content is not supported: lightinfer serves text models; "
                                          f"send text parts ({what})")
        if kind not in TEXT_PARTS:
            got = repr(kind) if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{at}[{k}]", f"must be a text part ({what}), got {got}")
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise _bad(f"{at}[{k}].{TEXT_PARTS[kind]}", "must be a string")
        parts.append({"type": "text", "text": text})
    return parts


def _string(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{at}.{key}", "is required (a non-empty string)" if value is None else "must be a non-empty string")
    return value


def _messages(req: RP.ResponsesRequest, src: ChatSources) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    def add(message: dict[str, Any], where: str) -> None:
        messages.append(message)
        src.messages.append(where)

    if req.instructions:
        add({"role": "system", "content": req.instructions}, "instructions")
    if isinstance(req.input, str):
        add({"role": "user", "content": req.input}, "input")
        return messages
    for j, item in enumerate(req.input):
        at = f"input[{j}]"
        if not isinstance(item, dict):
            raise _bad(at, f"must be an object: one of {ITEM_KINDS}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{at}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
            if item.get("content") is None:
                raise _bad(f"{at}.content", "is required")
            add({"role": role, "content": _text_parts(item["content"], f"{at}.content", "input_text or output_text")},
                at)
        elif kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise _bad(f"{at}.arguments", "is required: the call's arguments as JSON text")
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": args}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after an assistant message join it
                add({"role": "assistant", "content": None}, at)
                last = messages[-1]
            last.setdefault("tool_calls", []).append(call)
            src.calls[(len(messages) - 1, len(last["tool_calls"]) - 1)] = at
        elif kind == "function_call_output":
            if item.get("output") is None:
                raise _bad(f"{at}.output", "is required: the call's result")
            add({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                 "content": _text_parts(item["output"], f"{at}.output", "input_text")}, at)
        elif kind == "reasoning":
            continue  # another model's reasoning (often encrypted): not something this model can read
        elif kind == "item_reference":
            raise _bad(f"{at}.type", f"{RP.NOT_STORED}: send the item itself instead of a reference to it")
        else:
            raise _bad(f"{at}.type", f"{kind!r} items are not supported by lightinfer; send {ITEM_KINDS}")
    if not messages:
        raise _bad("input", "has no message or function call (reasoning items are ignored)")
    return messages


def _tools(tools: list[Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Function ``tools`` in Chat Completions' shape, and as the response echoes them."""
    chat, echo = [], []
    for i, tool in enumerate(tools or []):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(at, "must be an object {\"type\": \"function\", \"name\", \"description\", \"parameters\"}")
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"{at}.type", f"{kind!r} tools are not supported by lightinfer (it runs no built-in or hosted "
                                     "tools); only {\"type\": \"function\"} tools, which the client runs")
        if "name" not in tool and isinstance(tool.get("function"), dict):
            raise _bad(f"{at}.name", "is required: the Responses API takes function tools flat ({\"type\": "
                                     "\"function\", \"name\", \"parameters\"}), not nested under \"function\" as "
                                     "Chat Completions does")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "description": None, "parameters": None, "strict": None, **fn})
    return chat, echo


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "is required: the name of one of the function tools")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise _bad("tool_choice.type", f"{choice['type']!r} is not supported by lightinfer; use \"auto\", \"none\", "
                                       "\"required\" or {\"type\": \"function\", \"name\": ...}")
    raise _bad("tool_choice", f"must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": ...}}, "
                              f"got {choice!r}")


def _response_format(text: RP.TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise _bad("text.format.schema", "is required with type \"json_schema\": the JSON Schema the reply must match")
    spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _loc(loc: tuple[Any, ...]) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")


def to_chat_request(req: RP.ResponsesRequest) -> tuple[P.ChatCompletionRequest, ChatSources, list[dict[str, Any]]]:
    """The Chat Completions request equivalent to ``req``, where each of its messages came from, and the function
    tools as the response echoes them.

    Raises:
        OpenAIError: 400 naming the Responses field: an item of an unknown or unsupported type (``input[2].type``),
            an image or file part (``input[0].content[1].type``), a function_call or function_call_output without
            its ``call_id``, a tool that is not a function (``tools[0].type``), a ``tool_choice`` of another kind, a
            ``text.format`` json_schema without ``schema``.
    """
    src = ChatSources()
    messages = _messages(req, src)
    tools, echo = _tools(req.tools)
    chat: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": tools or None, "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p}
    try:
        return P.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), src, echo
    except ValidationError as exc:  # e.g. text that is not Unicode (a lone surrogate)
        first = exc.errors()[0]
        where = _loc(first.get("loc", ()))
        msg = str(first.get("msg", "")).removeprefix("Value error, ")
        raise src.rename(OpenAIError(400, f"{where}: {msg}", param=where or None)) from None


# ---------------------------------------------------------------------------- engine output -> output items
class ResponseBuilder:
    """The output items of one response, built from the reply's pieces in order (text; a call's start; its
    arguments), and, when ``stream``, the server-sent events each step makes (:meth:`drain`).

    Args:
        response: the response object (settings echoed; ``output`` empty); filled in place.
        stream: keep the events (a whole response needs only the items).
    """

    def __init__(self, response: RP.ResponseObject, stream: bool) -> None:
        self.response = response
        self.stream = stream
        self.seq = 0
        self.open: RP.OutputMessage | RP.FunctionCallItem | None = None
        self._events: list[str] = []

    def _emit(self, cls: type[Any], **fields: Any) -> None:
        if self.stream:
            self._events.append(RP.sse_event(cls(sequence_number=self.seq, **fields)))
            self.seq += 1

    def drain(self) -> list[str]:
        """The events made since the last call."""
        events, self._events = self._events, []
        return events

    def lifecycle(self, kind: str) -> None:
        """A ``response.<kind>`` event with the response as it stands."""
        self._emit(RP.LifecycleEvent, type=f"response.{kind}", response=self.response)

    def _add(self, item: RP.OutputMessage | RP.FunctionCallItem) -> int:
        self.close()
        self.response.output.append(item)
        self.open = item
        index = len(self.response.output) - 1
        self._emit(RP.OutputItemEvent, type="response.output_item.added", output_index=index, item=item)
        return index

    def text(self, delta: str) -> None:
        """Append ``delta`` to the open message (opening one first when a call, or nothing, is open)."""
        if not delta:
            return
        if not isinstance(self.open, RP.OutputMessage):
            self._open_message()
        msg = self.open
        assert isinstance(msg, RP.OutputMessage)
        msg.content[0].text += delta
        self._emit(RP.TextDeltaEvent, item_id=msg.id, output_index=len(self.response.output) - 1, content_index=0,
                   delta=delta)

    def _open_message(self) -> None:
        msg = RP.OutputMessage()
        index = self._add(msg)
        msg.content.append(RP.OutputText())
        self._emit(RP.ContentPartEvent, type="response.content_part.added", item_id=msg.id, output_index=index,
                   content_index=0, part=RP.OutputText())

    def call(self, call_id: str, name: str) -> None:
        """Open a function_call item."""
        self._add(RP.FunctionCallItem(call_id=call_id, name=name))

    def arguments(self, piece: str) -> None:
        """Append ``piece`` to the open call's arguments."""
        if piece and isinstance(self.open, RP.FunctionCallItem):
            self.open.arguments += piece
            self._emit(RP.ArgumentsDeltaEvent, item_id=self.open.id, output_index=len(self.response.output) - 1,
                       delta=piece)

    def feed(self, pieces: list[dict[str, Any]]) -> None:
        """The tool-call parser's pieces (OpenAI chat deltas: ``{"content"}``, ``{"tool_calls": [...]}``)."""
        for piece in pieces:
            self.text(piece.get("content") or "")
            for tc in piece.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id") is not None:
                    self.call(tc["id"], fn.get("name") or "")
                self.arguments(fn.get("arguments") or "")

    def close(self, status: str = "completed") -> None:
        """Finish the open item (if any) with ``status``."""
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status  # type: ignore[assignment]
        index = len(self.response.output) - 1
        if isinstance(item, RP.OutputMessage):
            part = item.content[0]
            self._emit(RP.TextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=part.text)
            self._emit(RP.ContentPartEvent, type="response.content_part.done", item_id=item.id, output_index=index,
                       content_index=0, part=part)
        else:
            self._emit(RP.ArgumentsDoneEvent, item_id=item.id, output_index=index, name=item.name,
                       arguments=item.arguments)
        self._emit(RP.OutputItemEvent, type="response.output_item.done", output_index=index, item=item)

    def finish(self, final: RequestOutput) -> None:
        """The reply ended: close the open item, set status (``incomplete`` when ``max_output_tokens`` or the
        context ran out) and usage, and make the last event."""
        comp = final.outputs[0]
        incomplete = comp.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        if not self.response.output:  # no text and no call: still one (empty) message
            self._open_message()
        self.close(status)
        r = self.response
        r.status = status
        r.incomplete_details = RP.IncompleteDetails() if incomplete else None
        prompt, completion = len(final.prompt_token_ids), len(comp.token_ids)
        r.usage = RP.ResponseUsage(
            input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion,
            input_tokens_details=RP.InputTokensDetails(cached_tokens=final.num_cached_tokens or 0))
        self.lifecycle(status)

    def fail(self, err: OpenAIError) -> None:
        """The reply failed after the stream began: an ``error`` event, then ``response.failed``."""
        e = err.body.error
        self._emit(RP.ErrorEvent, code=e.code or e.type, message=e.message, param=e.param)
        self.response.status = "failed"
        self.response.error = RP.ResponseErrorInfo(message=e.message)
        self.lifecycle("failed")


def _pieces(calling: ToolCalling | None, parser: Any, delta: str, finished: bool) -> list[dict[str, Any]]:
    """New reply text as pieces: through the tool-call parser when the request has tools."""
    if calling is None:
        return [{"content": delta}] if delta else []
    pieces = parser.feed(delta) if delta else []
    return pieces + (parser.finish() if finished else [])


Submitted = list[tuple[str, RequestStream]]


def _abort(serving: OpenAIServing, subs: Submitted) -> None:
    for rid, _ in subs:
        serving.engine.abort(rid)


async def _full(serving: OpenAIServing, subs: Submitted, built: ResponseBuilder,
                calling: ToolCalling | None) -> JSONResponse:
    final = (await R.collect(subs))[0]
    parser = calling.stream_parser() if calling is not None else None
    built.feed(_pieces(calling, parser, final.outputs[0].text, True))
    built.finish(final)
    return JSONResponse(built.response.model_dump(mode="json", by_alias=True))


async def _stream(serving: OpenAIServing, subs: Submitted, built: ResponseBuilder,
                  calling: ToolCalling | None) -> AsyncIterator[str]:
    parser = calling.stream_parser() if calling is not None else None
    prev, last, finished = "", None, False
    try:
        built.lifecycle("created")
        built.lifecycle("in_progress")
        for event in built.drain():
            yield event
        async for _, out in R.merge_streams([s for _, s in subs]):
            last, comp = out, out.outputs[0]
            delta, prev = comp.text[len(prev):], comp.text
            built.feed(_pieces(calling, parser, delta, comp.finished))
            for event in built.drain():
                yield event
        finished = last is not None and last.finished
        if finished:
            built.finish(last)
        else:
            built.fail(OpenAIError(503, "the request was aborted by the server", "server_error", code="aborted"))
    except Exception as exc:  # noqa: BLE001 -- a failed step: tell this client, keep the server up
        err = as_openai_error(exc)
        logger.warning("responses stream ended with an error: %s", err.body.error.message)
        built.fail(err)
    finally:
        if not finished:
            _abort(serving, subs)
    for event in built.drain():
        yield event


def _echo(req: RP.ResponsesRequest, serving: OpenAIServing, tools: list[dict[str, Any]]) -> RP.ResponseObject:
    text = {"format": {"type": "text"}, "verbosity": "medium"}
    if req.text is not None and req.text.format is not None:
        text["format"] = req.text.format.model_dump(by_alias=True, exclude_none=True)
    return RP.ResponseObject(
        model=serving.model_name, instructions=req.instructions, tools=tools,
        tool_choice="auto" if req.tool_choice is None else req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls is not False, text=text,
        temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
        max_output_tokens=req.max_output_tokens, metadata=req.metadata or {}, user=req.user,
        prompt_cache_key=req.prompt_cache_key, safety_identifier=req.safety_identifier)


def register_responses_routes(app: FastAPI, models: ServedModels) -> None:
    """Add ``POST /responses`` and ``GET`` / ``DELETE /responses/{response_id}`` (a 404: nothing is stored) to
    ``app`` (the ``/v1`` app, whose handlers turn :class:`OpenAIError` into OpenAI's error JSON).

    Args:
        app: the ``/v1`` FastAPI app (:func:`lightinfer.entrypoints.openai_api.create_openai_app`).
        models: the served models; each request reaches its model through ``models.use``.
    """

    @app.post("/responses", response_model=None)
    async def create_response(req: RP.ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API, stateless, through the chat template and the Chat Completions machinery:
        ``input`` (a string, or messages, ``function_call`` and ``function_call_output`` items), ``instructions``,
        function ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (JSON schemas by constrained
        decoding), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream`` (OpenAI's event sequence).
        Nothing is stored: ``previous_response_id`` is refused; send the conversation in ``input``."""
        async with models.use(req.model) as serving:
            chat, sources, tools = to_chat_request(req)
            try:
                request, calling = await serving.prepare_chat(chat, None)
            except OpenAIError as err:
                raise sources.rename(err) from None
            subs = await serving.submit([request])
        logger.info("responses request %s: %d prompt tokens, stream=%s", subs[0][0], len(request.prompt_token_ids),
                    req.stream)
        built = ResponseBuilder(_echo(req, serving, tools), stream=req.stream)
        if req.stream:
            return StreamingResponse(_stream(serving, subs, built, calling), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await run_until_disconnect(raw, _full(serving, subs, built, calling), [r for r, _ in subs],
                                          serving.engine)

    def not_stored(response_id: str) -> OpenAIError:
        return OpenAIError(404, f"No response found with id {json.dumps(response_id)}: {RP.NOT_STORED}; "
                                f"{RP.SEND_INPUT}", param="response_id", code="response_not_found")

    @app.get("/responses/{response_id}", response_model=None)
    async def retrieve_response(response_id: str) -> Response:
        """Always 404: lightinfer stores no responses (``store`` is false)."""
        raise not_stored(response_id)

    @app.delete("/responses/{response_id}", response_model=None)
    async def delete_response(response_id: str) -> Response:
        """Always 404: lightinfer stores no responses (``store`` is false)."""
        raise not_stored(response_id)
