"""Pydantic schemas of the OpenAI-compatible API (the subset lightinfer serves).

Field names and meanings follow OpenAI's API reference; ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens`` and ``stop_token_ids`` are extras (as in
vLLM) that the official client sends through ``extra_body``. Unknown fields are ignored; OpenAI fields
that lightinfer does not implement (``UNSUPPORTED``: JSON mode, tools, ``logit_bias``, ``best_of``,
``suffix``) are a 400 when set, rather than a reply that silently ignores them. Range checks live here so a
bad value is a 400 naming the field before any work starts.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from lightinfer.inputs import check_text


def random_id(prefix: str) -> str:
    """``prefix-<24 hex digits>``, OpenAI's id style."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


# field -> (what it asks for, the values that ask for nothing): set to anything else, a clear 400.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "response_format": ("structured output (JSON mode / JSON schema)", (None, {"type": "text"})),
    "tools": ("tool calls", (None, [])),
    "tool_choice": ("tool calls", (None, "none", "auto")),  # "auto" with no tools asks for nothing
    "functions": ("function calls", (None, [])),
    "function_call": ("function calls", (None, "none", "auto")),
    "logit_bias": ("logit_bias", (None, {})),
    "suffix": ("suffix (insertion)", (None, "")),
}


def _refuse_unsupported(name: str, value: Any) -> Any:
    what, neutral = UNSUPPORTED[name]
    if value not in neutral:
        raise ValueError(f"{what} is not supported by lightinfer; leave {name} out")
    return value


def _unicode(value: Any, what: str) -> Any:
    """``value``'s strings (a str, or a list of str / text parts) checked to be valid Unicode."""
    for item in value if isinstance(value, list) else [value]:
        text = item if isinstance(item, str) else getattr(item, "text", None)
        if isinstance(text, str):
            check_text(text, what)
    return value


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    # allow_inf_nan=False: NaN/inf are a "finite number" error, not a confusing range one
    # strict: a JSON true is not max_tokens=1, nor "0.5" a temperature (OpenAI refuses both; ints still pass
    # for float fields)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None

    @field_validator(*[f for f in UNSUPPORTED if f != "suffix"])
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(info.field_name, value)

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: Any) -> Any:
        return _unicode(value, "a stop string")


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; ``content`` is a string or a list of text parts (other part types: 400). It is required, as
    OpenAI requires it of every message without tool calls (which this server does not take)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_text(cls, value: Any) -> Any:
        return _unicode(value, "the message content")

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")  # as OpenAI's API
        return value


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: Any) -> Any:
        return _unicode(value, "the prompt")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _refuse_unsupported("suffix", value)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of (sampling more completions than are returned) is not supported by lightinfer; "
                             "leave it out, or use n")
        return value


# ---------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lightinfer"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>\\n\\n`` (a str is sent as is, e.g. ``[DONE]``)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        body = json.dumps(payload)
    else:
        body = payload
    return f"data: {body}\n\n"
