"""Pydantic schemas of the Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): the
subset lightinfer serves, with Anthropic's field names and shapes.

Served: ``model``, ``messages`` (``user`` / ``assistant``; content a string or ``text``, ``tool_use`` and
``tool_result`` blocks), ``system`` (a string or text blocks), ``max_tokens`` (required, as Anthropic requires
it), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools`` (custom tools: ``name``,
``description``, ``input_schema``), ``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``,
``disable_parallel_tool_use``), ``output_config.format`` (a JSON schema the reply follows), ``stream``.
Accepted and ignored, as they ask nothing of the reply's text: ``metadata``, ``service_tier``,
``cache_control`` (top level and on blocks), ``citations`` on text blocks, ``inference_geo``, ``speed``,
``user_profile_id``, ``workspace_id``, ``diagnostics``, ``context_management``, ``output_config.effort``,
``thinking: {"type": "disabled"}``. Refused with a 400 that says so: images, documents, thinking blocks and
other block types of Anthropic's hosted features, extended thinking, Anthropic's server tools (web search,
code execution...), ``container``, ``mcp_servers``. A field Anthropic does not document is a 400 naming it,
as Anthropic answers (a misspelt setting is never silently dropped).

The checks here name the field the way the error message shows it (``messages.1.content.0``); the request
is then turned into the equivalent Chat Completions request (``anthropic_api.to_chat_request``).
"""

from __future__ import annotations

import secrets
import string
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lightinfer.inputs import check_text

_ALNUM = string.ascii_letters + string.digits


def anthropic_id(prefix: str) -> str:
    """``prefix_<24 letters and digits>``, Anthropic's id style (``msg_...``, ``toolu_...``)."""
    return f"{prefix}_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# ---------------------------------------------------------------------------- errors
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


class ErrorInfo(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}`` (also a stream's ``error``
    event)."""

    type: Literal["error"] = "error"
    error: ErrorInfo


# ---------------------------------------------------------------------------- request content blocks
# block types of Anthropic's API that lightinfer does not serve, and why (a 400 says it)
UNSUPPORTED_BLOCKS = {
    "image": "image blocks are not supported: lightinfer serves text models",
    "document": "document blocks (PDFs, citations) are not supported: send the text as a text block",
    "search_result": "search_result blocks are not supported: send the text as a text block",
    "thinking": "thinking blocks are not supported: lightinfer does not do extended thinking (leave them out)",
    "redacted_thinking": "redacted_thinking blocks are not supported: lightinfer does not do extended thinking",
    "container_upload": "container_upload blocks are not supported (no code-execution container)",
}
_SERVER_TOOL_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                       "code_execution_tool_result", "bash_code_execution_tool_result",
                       "text_editor_code_execution_tool_result", "tool_search_tool_result", "mcp_tool_use",
                       "mcp_tool_result")
ALLOWED_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use"), "system": ("text",),
                  "tool_result": ("text",)}


def check_blocks(value: Any, role: str) -> Any:
    """``value``, a string or a list of content blocks, with the blocks read into their models, each of a
    ``type`` that ``role`` may send (``ALLOWED_BLOCKS``). Checked here, block by block, so that an image is
    "not supported" and a bad block is named by its index, not by the union branches that failed.

    Raises:
        ValueError: naming the block ("block 2: ...") and what is wrong: an unsupported type (and what is
            allowed), or a bad field of the block ("block 0: text: Field required").
    """
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be a string or a list of content blocks, got {type(value).__name__}")  # noqa: TRY004
    allowed = ALLOWED_BLOCKS[role]
    blocks = []
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            reason = "a content block is an object with a \"type\""
        elif kind in allowed:
            try:
                blocks.append(_BLOCK_MODELS[kind].model_validate(block))
            except ValidationError as exc:
                e = exc.errors()[0]
                where = ".".join(str(x) for x in e.get("loc", ()))
                raise ValueError(f"block {i}: {where + ': ' if where else ''}"
                                 f"{str(e.get('msg', '')).removeprefix('Value error, ')}") from None
            continue
        elif kind in UNSUPPORTED_BLOCKS:
            reason = UNSUPPORTED_BLOCKS[kind]
        elif kind in _SERVER_TOOL_BLOCKS:
            reason = f"{kind} blocks (Anthropic's server tools) are not supported"
        elif kind in ("text", "tool_use", "tool_result"):
            reason = f"{kind} blocks do not belong in {role} content"
        else:
            reason = f"{kind!r} is not a content block type"
        raise ValueError(f"block {i}: {reason}; {role} content may hold blocks of type "
                         f"{' and '.join(repr(a) for a in allowed)}")
    return blocks


class TextBlock(BaseModel):
    """``{"type": "text", "text"}`` (``cache_control`` and ``citations`` are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, value: str) -> str:
        return check_text(value, "a text block")


class ToolUseBlock(BaseModel):
    """An assistant's earlier call: ``{"type": "tool_use", "id", "name", "input": {...}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A tool's answer in a user message: ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``;
    ``content`` a string or text blocks (images in results: 400)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return check_blocks(value, "tool_result")

    def text(self) -> str:
        """The result as one string (text blocks joined by newlines; "" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return check_text(self.content, "a tool result")
        return "\n".join(b.text for b in self.content)


_BLOCK_MODELS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock,
                                              "tool_result": ToolResultBlock}
Block = TextBlock | ToolUseBlock | ToolResultBlock  # read by check_blocks, which names a bad one


class Message(BaseModel):
    """One turn: ``role`` "user" or "assistant", ``content`` a string or blocks (``ALLOWED_BLOCKS``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("role", mode="before")
    @classmethod
    def _no_system_role(cls, value: Any) -> Any:
        if value == "system":
            raise ValueError("messages take the roles \"user\" and \"assistant\"; send the system prompt as the "
                             "top-level \"system\" field")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _block_types(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        return check_blocks(value, role) if role in ("user", "assistant") else []  # a bad role: that error alone

    @field_validator("content")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        if (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value):
            raise ValueError("a message's content must not be empty: give it text or blocks (as Anthropic's API "
                             "requires)")
        return check_text(value, "the message content") if isinstance(value, str) else value


# ---------------------------------------------------------------------------- tools
class Tool(BaseModel):
    """A custom tool: ``name``, ``description``, ``input_schema`` (a JSON Schema of the call's input).
    ``cache_control``, ``strict`` (calls always follow the schema here) and the like are accepted and ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} (one of Anthropic's server tools) is not supported by "
                             "lightinfer; define a custom tool with name, description and input_schema")
        return value


class ToolChoice(BaseModel):
    """``{"type": "auto" | "any" | "tool" | "none", "name" (with "tool"), "disable_parallel_tool_use"}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type \"tool\" needs the name of the tool to call")
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``format``: the reply is JSON following ``format.schema`` (constrained decoding); ``effort`` (a hint of
    how much to think) is accepted and ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: OutputFormat | None = None
    effort: str | None = None


# field -> (what it asks for, the values that ask for nothing): set to anything else, a clear 400
UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "container": ("container (Anthropic's code-execution containers)", (None,)),
    "mcp_servers": ("mcp_servers (Anthropic's MCP connector)", (None, [])),
}


# ---------------------------------------------------------------------------- requests
class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: the conversation, system prompt and tools of a Messages request. The
    generation fields (``max_tokens``, ``stream``, ``stop_sequences``, sampling) are accepted and do not change
    the count, so the same body can be sent to both routes."""

    # allow_inf_nan=False: NaN/inf are a "finite number" error; strict: "0.5" is no temperature, true no
    # max_tokens; extra="forbid": an unknown field is a 400 naming it, as Anthropic answers
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    # refused unless asking for nothing
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: Any = None
    # labels and hints that change nothing in the reply's text: accepted, ignored
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return check_blocks(value, "system")

    @field_validator("system")
    @classmethod
    def _system_unicode(cls, value: Any) -> Any:
        return check_text(value, "the system prompt") if isinstance(value, str) else value

    @field_validator("stop_sequences")
    @classmethod
    def _stop_text(cls, value: list[str] | None) -> list[str] | None:
        for i, stop in enumerate(value or []):
            if not stop:
                raise ValueError(f"stop sequence {i} is empty")
            check_text(stop, "a stop sequence")
        return value

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "disabled":
            raise ValueError(f"extended thinking (type {value.get('type')!r}) is not supported by lightinfer; "
                             "leave thinking out, or send {\"type\": \"disabled\"}")
        return value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        what, neutral = UNSUPPORTED[info.field_name]
        if not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError(f"{what} is not supported by lightinfer; leave {info.field_name} out")
        return value

    def system_text(self) -> str | None:
        """The system prompt as one string (text blocks joined by blank lines); None without one."""
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(b.text for b in self.system) or None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: ``max_tokens`` is required (Anthropic's rule: no default length)."""

    max_tokens: int = Field(ge=1)


# ---------------------------------------------------------------------------- responses
class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    """The reply: ``content`` text and ``tool_use`` blocks, ``stop_reason`` and ``stop_sequence`` (the stop
    sequence met, with "stop_sequence"), token ``usage``."""

    id: str = Field(default_factory=lambda: anthropic_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---------------------------------------------------------------------------- stream events
class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextContent | ToolUseContent


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


def sse_event(event: BaseModel) -> str:
    """One server-sent event as Anthropic streams them: ``event: <type>\\ndata: <json>\\n\\n``."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]
