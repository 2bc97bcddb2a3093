"""Chat messages -> prompt, through the tokenizer's chat template: the one implementation that
``LLM.chat``, the OpenAI API, the chat UI and ``lightinfer generate --chat`` share.

The template renders text (``tokenize=False``) that is then encoded without special tokens
(the template writes them), which is what transformers' own ``tokenize=True`` does; keeping the
text makes it the request's prompt text.
"""

from __future__ import annotations

from typing import Any

from lightinfer.inputs.data import InputError, TokenizedPrompt
from lightinfer.inputs.text import check_text, message_text
from lightinfer.inputs.tools import (
    check_tool_message,
    fallback_messages,
    normalize_tool_calls,
    template_renders_tools,
    with_mistral_ids,
)
from lightinfer.structured.tool_formats import ToolCallFormat, detect_tool_call_format

Message = dict[str, Any]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # as the OpenAI API takes them


def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """``messages`` checked and reduced to what templates read: ``[{"role", "content"}]``, the content as
    one string, OpenAI's ``developer`` role as ``system``; an assistant message's ``tool_calls`` (its
    content may then be null or left out) with their arguments as dicts; a ``tool`` message's
    ``tool_call_id``, which must answer a call of an earlier assistant message, and that call's ``name``.

    Raises:
        ValueError: no messages, a message without role/content or with an unknown role, content that
            is not text, or text that is not valid Unicode; :class:`InputError` naming the field for a bad
            tool call or a ``tool_call_id`` that matches no earlier call.
    """
    if isinstance(messages, (str, dict)) or not messages:
        raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages"
                         + (f", got {type(messages).__name__}" if messages else ", got an empty one"))
    clean: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool-call id -> function name, of the assistant messages so far
    for i, m in enumerate(messages):
        has_calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not has_calls):
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        if m["role"] == "tool":
            clean.append(check_tool_message(m, i, calls))
            continue
        role = "system" if m["role"] == "developer" else str(m["role"])  # OpenAI's newer name for system
        content = "" if has_calls and m.get("content") is None else m["content"]
        msg: dict[str, Any] = {"role": role, "content": check_text(message_text(content), f"a {role} message")}
        if has_calls:  # only then: templates test `'tool_calls' in message`
            msg["tool_calls"] = normalize_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            calls.update((c["id"], c["function"]["name"]) for c in msg["tool_calls"])
        clean.append(msg)
    return clean


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tool_format: ToolCallFormat | None = None,
) -> TokenizedPrompt:
    """The conversation through the tokenizer's chat template, as text and token ids.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template`` (None: an engine without one).
        messages: ``[{"role", "content"}]`` (and tool calls / results), see :func:`normalize_messages`.
        add_generation_prompt: end with the header of the assistant's reply (to generate it).
        tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``). A template that
            renders tools gets them (transformers' ``tools=``); one that does not gets the fallback tool
            prompt in the system message (:mod:`lightinfer.inputs.tools`).
        chat_template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
        tool_format: the tool-call format the reply will be parsed in (default: detected from the
            template); the fallback prompt teaches it, and Mistral's gets its 9-character call ids.
    Returns:
        the rendered text and its ids (no length check: see :class:`lightinfer.inputs.InputProcessor`).
    Raises:
        ValueError: bad messages (:func:`normalize_messages`), no tokenizer or no chat template;
            :class:`InputError` (``param="messages"``) when the template itself refuses them (e.g.
            roles that do not alternate).
    """
    clean = normalize_messages(messages)
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init or a dummy model): chat needs one")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template, so it cannot take chat messages; send a "
                         "plain prompt instead (LLM.generate, or /v1/completions)")
    extra = dict(chat_template_kwargs or {})
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in clean)
    if uses_tools:
        template = tokenizer.chat_template
        fmt = tool_format or detect_tool_call_format(template if isinstance(template, str) else None)
        if not template_renders_tools(tokenizer):
            clean, tools = fallback_messages(clean, tools, fmt), None
        elif fmt.name == "mistral":
            clean = with_mistral_ids(clean)
    if tools is not None:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **extra)
    except Exception as exc:  # jinja errors, e.g. roles the template does not allow
        raise InputError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    return TokenizedPrompt(text, list(tokenizer.encode(text, add_special_tokens=False)))


def fit_context(tokenizer: Any, system: str, turns: list[Message], max_model_len: int,
                max_new_tokens: int) -> tuple[TokenizedPrompt, int, int]:
    """Template a chat, dropping the oldest turns until it fits the context (the chat UI's policy).

    Args:
        system: the system prompt ("" or blank: none).
        turns: the conversation without the system prompt, oldest first.
        max_model_len: the context length in tokens.
        max_new_tokens: the reply's wished length in tokens.
    Returns:
        ``(prompt, num_dropped_messages, max_new_tokens)``; the last may be lowered so that the
        prompt plus reply fit ``max_model_len``.
    Raises:
        ValueError: the newest message alone (with the system prompt) does not fit, or see
            :func:`render_chat`.
    """
    head = [{"role": "system", "content": system}] if system.strip() else []
    dropped = 0
    while True:
        prompt = render_chat(tokenizer, head + turns)
        num_tokens = len(prompt.prompt_token_ids)
        if num_tokens + max_new_tokens <= max_model_len or len(turns) <= 1:
            break
        # drop the oldest user turn and the reply to it, so the conversation still starts with a user
        cut = 1
        while cut < len(turns) - 1 and turns[cut]["role"] != "user":
            cut += 1
        turns, dropped = turns[cut:], dropped + cut
    if num_tokens >= max_model_len:
        raise ValueError(f"the message is {num_tokens} tokens long; the model's context holds {max_model_len}")
    return prompt, dropped, min(max_new_tokens, max_model_len - num_tokens)
