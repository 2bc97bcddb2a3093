"""Checks on the text a caller sends: valid Unicode, and the text of a chat message's content."""

from __future__ import annotations


def check_text(text: str, what: str) -> str:
    """``text`` if it can be encoded as UTF-8 (the tokenizer needs that), else a ValueError naming ``what``
    and the position: a lone UTF-16 surrogate (``"\\ud800"``, from a JSON ``\\u`` escape or a bad decode)
    is a Python string but not Unicode text, and would fail deep inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}; "
                         f"send UTF-8 text") from None
    return text


def message_text(content: object) -> str:
    """A chat message's text: a plain string, or the text parts of a list of content blocks
    (OpenAI / Gradio style ``[{"type": "text", "text": ...}, ...]``).

    Raises:
        ValueError: ``content`` is none of these (e.g. a number or None).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
        return "".join(parts)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    raise ValueError(f"message content must be a string or a list of text blocks, got {type(content).__name__}")
