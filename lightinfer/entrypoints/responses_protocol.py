"""Pydantic schemas of OpenAI's Responses API (``POST /v1/responses``), the subset lightinfer serves.

The request (:class:`ResponsesRequest`) keeps OpenAI's field names. As in :mod:`protocol`, a field OpenAI does
not document is a 400 naming it ("Unrecognized request argument supplied: ..."); fields that only label a
request (``store``, ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``...) are
accepted and change nothing; documented features lightinfer does not implement (:data:`RESPONSES_UNSUPPORTED`:
``conversation``, ``background``, ``truncation: "auto"``, ``reasoning`` settings, ``top_logprobs``...) are
accepted at the value that asks for nothing and a 400 saying so otherwise. ``previous_response_id`` is always a
400: nothing is stored, the conversation goes in ``input``. ``input`` items, ``tools``, ``tool_choice`` and
``text.format`` are checked where they are converted to a chat request (:mod:`responses_api`), which names the
field (``input[2].call_id``, ``tools[0].type``...).

The reply (:class:`ResponseObject`: output items :class:`OutputMessage` / :class:`FunctionCallItem`,
:class:`ResponseUsage`) and the stream's events (:func:`sse_event`) have the shapes the official ``openai``
client's ``openai.types.responses`` models read.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def response_id(prefix: str = "resp") -> str:
    """``<prefix>_<32 hex digits>``: OpenAI's id style for responses (``resp_``), messages (``msg_``) and
    function-call items (``fc_``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


NOT_STORED = ("lightinfer does not store responses (every response has store: false), so there is nothing "
              "to retrieve or continue")
SEND_INPUT = "send the whole conversation in `input` instead (earlier messages, function_call and " \
             "function_call_output items)"

# field -> (what it asks for, the values that ask for nothing, how to do without): set to anything else, a 400
RESPONSES_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...], str]] = {
    "conversation": ("conversation (server-side conversation state)", (None,), f"; {SEND_INPUT}"),
    "background": ("background (asynchronous responses)", (None, False), ""),
    "background_options": ("background_options", (None,), ""),
    "prompt": ("prompt (stored prompt templates)", (None,), "; send instructions and input instead"),
    "truncation": ("truncation \"auto\" (dropping the start of a conversation that is too long)",
                   (None, "disabled"), "; shorten input yourself"),
    "top_logprobs": ("top_logprobs", (None, 0), ""),
    "max_tool_calls": ("max_tool_calls", (None,), "; set parallel_tool_calls to false for one call per reply"),
    "context_management": ("context_management (server-side compaction)", (None, []), ""),
    "moderation": ("moderation", (None,), ""),
    "access_programs": ("access_programs", (None,), ""),
    "image": ("image settings (lightinfer serves text models)", (None,), ""),
    "prompt_cache_options": ("prompt_cache_options (the prefix cache works without them)", (None, {}), ""),
}
# include: what the output should carry besides its text. Reasoning items are never produced, so asking for
# their encrypted content (as Codex does) asks for nothing.
INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or ``{"type": "json_schema", "name",
    "schema", "strict", "description"}`` (the schema is enforced by constrained decoding whatever ``strict``
    says)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: the output's ``format`` and ``verbosity`` (only "medium", the model's own, is served)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"verbosity {value!r} is not supported by lightinfer (the model answers as it does); "
                             "leave it out or use \"medium\"")
        return value


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_obfuscation: bool = False  # accepted; lightinfer's events carry no obfuscation padding


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. ``input``: a string (one user message) or a list of items: messages
    (``{"type": "message", "role", "content"}``; ``type`` may be left out), ``function_call`` (``call_id``,
    ``name``, ``arguments``) and ``function_call_output`` (``call_id``, ``output``) items, ``reasoning`` items
    (ignored: lightinfer never produces them and cannot read another model's). Items are checked in
    :func:`lightinfer.entrypoints.responses_api.to_chat_request`, which names the bad one."""

    # as protocol._SamplingRequest: unknown fields are a 400 naming them, no NaN, no "0.5" for a number
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    # labels of the request, which change nothing in the reply (store: nothing is stored whatever it says)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # not implemented: a 400 unless set to the value that asks for nothing (RESPONSES_UNSUPPORTED)
    conversation: Any = None
    background: Any = None
    background_options: Any = None
    prompt: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    image: Any = None
    prompt_cache_options: Any = None

    @field_validator(*RESPONSES_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        what, neutral, instead = RESPONSES_UNSUPPORTED[info.field_name]
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError(f"{what} is not supported by lightinfer; leave {info.field_name} out{instead}")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _not_stored(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(f"{NOT_STORED}: {SEND_INPUT}, and leave previous_response_id out")
        return value

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if (isinstance(value, list) and not value) or (isinstance(value, str) and not value.strip()):
            raise ValueError("must not be empty: give a string or a list of items")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        other = [v for v in value or [] if v not in INCLUDE_ACCEPTED]
        if other:
            raise ValueError(f"{', '.join(map(repr, other))} cannot be included: lightinfer's output has text and "
                             "function calls only; leave include out")
        return value

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning_settings(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        asked = {k: v for k, v in (value or {}).items() if v is not None and not (k == "effort" and v == "none")}
        if asked:
            raise ValueError(f"reasoning settings ({', '.join(sorted(asked))}) are not supported by lightinfer: "
                             "a model thinks (in its text) as its chat template has it; leave reasoning out")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value


# ---------------------------------------------------------------------------- the response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    """The assistant's text: one ``output_text`` part."""

    id: str = Field(default_factory=lambda: response_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call of one of the request's function tools; ``arguments`` is its JSON text. The client runs it and
    sends the result back as a ``function_call_output`` item with the same ``call_id``."""

    id: str = Field(default_factory=lambda: response_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's prompt-caching bill: nothing is billed here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseErrorInfo(BaseModel):
    """A failed response's ``error`` (its ``code`` is one OpenAI's client knows)."""

    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The ``response`` object: the output items and usage, with the request's settings echoed (the fields the
    official client's ``Response`` model requires). ``store`` is always false."""

    id: str = Field(default_factory=response_id)
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputMessage | FunctionCallItem] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    previous_response_id: None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: Literal[False] = False
    background: Literal[False] = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: str = "default"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    usage: ResponseUsage | None = None


# ---------------------------------------------------------------------------- stream events
class _Event(BaseModel):
    sequence_number: int  # 0, 1, 2... over one stream


class LifecycleEvent(_Event):
    """The response as it stands: ``response.created`` and ``response.in_progress`` first (no output yet), then
    ``response.completed``, ``response.incomplete`` or ``response.failed`` with everything."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    """An output item opens (``added``: no text or arguments yet) or is complete (``done``)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputMessage | FunctionCallItem


class ContentPartEvent(_Event):
    """A message's ``output_text`` part opens (empty) or is complete."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    """A failure after the stream began (a failed engine step, an aborted request): OpenAI's error fields."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


def sse_event(event: _Event) -> str:
    """One server-sent event of a Responses stream: an ``event: <type>`` line and the event as JSON ``data``."""
    return f"event: {event.type}\ndata: {event.model_dump_json(by_alias=True)}\n\n"  # type: ignore[attr-defined]
