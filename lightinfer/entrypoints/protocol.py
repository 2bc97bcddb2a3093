"""Pydantic schemas of the OpenAI-compatible API (the subset lightinfer serves).

Field names and meanings follow OpenAI's API reference; ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``request_id`` and the structured-output ``guided_*`` / ``structured_outputs`` fields are extras (as in vLLM)
that the official client sends through ``extra_body``.

A field that neither OpenAI nor vLLM documents for the endpoint is a 400 naming it, as OpenAI answers
("Unrecognized request argument supplied: max_token"), so a misspelt setting is never silently dropped
(``openai_errors.validation_error_response``). Documented fields that lightinfer does not implement
(``UNSUPPORTED``, ``CHAT_UNSUPPORTED``: ``logit_bias``, ``suffix``, ``best_of``, the deprecated
``functions`` / ``function_call``, vLLM's ``include_stop_str_in_output``, beam search, ...) are accepted at
the value that asks for nothing and a 400 saying so otherwise. Fields that only label a request (``user``,
``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``) are accepted and
change nothing in the reply. Range checks live here so a bad value is a 400 naming the field before any
work starts; ``response_format``, ``tools`` and the structured-output fields are checked where the request
is prepared (``openai_structured``, the input layer).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

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


# field -> (what it asks for, the values that ask for nothing): set to anything else, a clear 400. Fields of
# OpenAI's API and vLLM's documented extras, both endpoints.
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("functions (OpenAI's deprecated form of tools)", (None, [])),
    "function_call": ("function_call (OpenAI's deprecated form of tool_choice)", (None, "none", "auto")),
    "logit_bias": ("logit_bias", (None, {})),
    "suffix": ("suffix (insertion)", (None, "")),
    "use_beam_search": ("use_beam_search (beam search)", (None, False)),
    "length_penalty": ("length_penalty (a beam-search setting)", (None, 1, 1.0)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (None, False)),
    "spaces_between_special_tokens": ("spaces_between_special_tokens: false", (None, True)),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", (None,)),
    "prompt_logprobs": ("prompt_logprobs", (None,)),
    "allowed_token_ids": ("allowed_token_ids", (None,)),
    "bad_words": ("bad_words", (None, [])),
    "logits_processors": ("logits_processors", (None, [])),
    "return_tokens_as_token_ids": ("return_tokens_as_token_ids", (None, False)),
    "return_token_ids": ("return_token_ids", (None, False)),
    "priority": ("priority (priority scheduling)", (None, 0)),
    "cache_salt": ("cache_salt (per-tenant prefix-cache isolation)", (None,)),
    "structural_tag": ("structural_tag", (None,)),
    "guided_whitespace_pattern": ("guided_whitespace_pattern", (None,)),
    "guided_decoding_backend": ("guided_decoding_backend other than llguidance",
                                (None, "auto", "guidance", "llguidance")),
    "kv_transfer_params": ("kv_transfer_params (disaggregated prefill)", (None,)),
    "vllm_xargs": ("vllm_xargs", (None, {})),
    "mm_processor_kwargs": ("mm_processor_kwargs (lightinfer serves text models)", (None, {})),
}
# the same for chat-only fields
CHAT_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "echo": ("echo on chat completions", (None, False)),
    "continue_final_message": ("continue_final_message", (None, False)),
    "add_special_tokens": ("add_special_tokens on chat completions (the chat template places them)", (None, False)),
    "documents": ("documents (RAG chat templates)", (None, [])),
    "chat_template": ("chat_template (a template per request)", (None,)),
    "reasoning_effort": ("reasoning_effort", (None,)),
    "modalities": ("modalities other than text", (None, ["text"])),
    "audio": ("audio output", (None,)),
    "prediction": ("prediction (predicted outputs)", (None,)),
    "web_search_options": ("web_search_options", (None,)),
    "verbosity": ("verbosity", (None, "medium")),
}
_INSTEAD = {"functions": "; send tools instead", "function_call": "; send tool_choice instead"}
MAX_STOP = 4  # OpenAI's limit on stop sequences


def _refuse_unsupported(name: str, value: Any) -> Any:
    what, neutral = UNSUPPORTED[name] if name in UNSUPPORTED else CHAT_UNSUPPORTED[name]
    if value is not None and not any(type(value) is type(n) and value == n for n in neutral):  # True is not 1
        raise ValueError(f"{what} is not supported by lightinfer; leave {name} out{_INSTEAD.get(name, '')}")
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
    # extra="forbid": an unknown field is a 400 naming it (openai_errors), as OpenAI answers
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

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
    skip_special_tokens: bool = True
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # a signed 64-bit integer, as OpenAI takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = Field(None, min_length=1, max_length=128)  # vLLM's: the response id's suffix
    # labels of the request (OpenAI's), which change nothing in the reply
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # structured outputs (checked by openai_structured when the request is prepared)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # not implemented: a 400 unless set to the value that asks for nothing (UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    priority: Any = None
    cache_salt: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    @field_validator(*[f for f in UNSUPPORTED if f != "suffix"])
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(info.field_name, value)

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed (as OpenAI allows), got {len(value)}")
        return _unicode(value, "a stop string")

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")  # as OpenAI and vLLM answer
        return value

    def response_id(self, prefix: str) -> str:
        """The response's id: ``prefix-<request_id>`` when the request names one (vLLM's), else a random one."""
        return f"{prefix}-{self.request_id}" if self.request_id else random_id(prefix)


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as a JSON string (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message (in a request's history, or in a response)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message; ``content`` is a string or a list of text parts (other part types: 400). It is required, as
    OpenAI requires it, except of an assistant message with ``tool_calls``; a ``tool`` message answers the
    call named by ``tool_call_id`` (checked against the earlier calls when the request is prepared)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # after tool_calls, so that its check sees them
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Before the union's own checks, whose message for an image part lists every branch that failed.
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"content part {i} is of type {kind!r}; lightinfer serves text models, so "
                                     f"only parts of type 'text' are accepted")
        return value

    @field_validator("content")
    @classmethod
    def _content_text(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("Field required (only an assistant message with tool_calls may leave content out)")
        return _unicode(value, "the message content")

    def text(self) -> str:
        """The content as one string (text parts joined; "" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_message(self) -> dict[str, Any]:
        """The message as the input layer takes it (OpenAI's dict shape)."""
        msg: dict[str, Any] = {"role": self.role, "content": None if self.content is None else self.text()}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # checked by the input layer (parse_tools / parse_tool_choice), which names the bad field
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    best_of: int | None = None  # vLLM takes it on chat too: only = n (no extra samples to pick from)
    # not implemented: a 400 unless set to the value that asks for nothing (CHAT_UNSUPPORTED)
    echo: Any = None
    continue_final_message: Any = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    @field_validator(*CHAT_UNSUPPORTED)
    @classmethod
    def _chat_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unsupported(info.field_name, value)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _best_of_is_n(value, info)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")  # as OpenAI's API
        return value


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    tools: Any = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's; False (no BOS added to the prompt) is not implemented

    @field_validator("add_special_tokens")
    @classmethod
    def _special_tokens_added(cls, value: bool) -> bool:
        if not value:
            raise ValueError("add_special_tokens: false is not supported by lightinfer (the prompt is tokenized "
                             "as the model's tokenizer does); leave it out, or send token ids")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, value: Any) -> Any:
        return _unicode(value, "the prompt")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _refuse_unsupported("suffix", value)

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value not in (None, []):
            raise ValueError("tools are served by /v1/chat/completions (they need the chat template); leave tools out")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _best_of_is_n(value, info)


def _best_of_is_n(value: int | None, info: ValidationInfo) -> int | None:
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
    # a many-model server's extras (lightinfer serve MODEL MODEL ... / --models-dir): left out by a one-model server
    state: Literal["loaded", "loading", "unloaded", "error"] | None = None
    format: str | None = None
    size_bytes: int | None = None
    pinned: bool | None = None
    error: str | None = None


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
    """A reply's message; ``tool_calls`` only when it called tools (OpenAI leaves the field out otherwise)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out


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
    """A piece of a streamed reply; ``tool_calls`` pieces are OpenAI's (``index`` always; ``id``, ``type`` and
    ``function.name`` in a call's first piece; ``function.arguments`` in pieces)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends only the fields a piece has ({"content": "Hi"}, or {} with a finish_reason), not nulls
        return {k: v for k, v in handler(self).items() if v is not None}


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
