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


# A normalizer may shrink text before it is split into tokens (composing "e" + U+0301 into "é", dropping
# control characters): the bound of :func:`longest_token_chars` then gets this much slack.
NORMALIZER_SLACK = 4


def longest_token_chars(tokenizer: object) -> int | None:
    """The most input characters one token can stand for: the longest entry of the vocabulary (added tokens
    included), times :data:`NORMALIZER_SLACK` when the tokenizer normalizes its input; None when the
    tokenizer cannot list its vocabulary (then no character bound is used).

    Why it bounds: a byte-level BPE token's vocabulary string has one character per byte it stands for, a
    SentencePiece piece one per character ("▁" for a space), so a text of ``n`` characters is at least
    ``n / longest`` tokens. :meth:`lightinfer.inputs.InputProcessor.check_text_size` uses that to refuse a
    text far beyond the context before tokenizing it.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        longest = max((len(t) for t in get_vocab()), default=0)
    except Exception:  # noqa: BLE001 -- a tokenizer that cannot list its vocabulary: no bound
        return None
    if longest <= 0:
        return None
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return longest * (NORMALIZER_SLACK if normalizer is not None else 1)
