"""A tolerant scanner for JSON objects that may still be growing (the streaming tool-call parser's
lexer): where each key's value starts and, once complete, ends; never decodes more than a key."""

from __future__ import annotations

import json

_WS = " \t\r\n"


class Invalid(ValueError):
    """The text cannot become a JSON object."""


def skip_ws(text: str, i: int) -> int:
    """The first index ``>= i`` that is not JSON whitespace (``len(text)`` if none)."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at ``text[i] == '"'``, or None while unterminated."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``, or None while it may still grow.
    A number/literal at the very end of the text is unfinished (more digits may follow)."""
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    if j == i:
        raise Invalid(f"no JSON value at {i}")
    return j if j < len(text) else None


def scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Scan the object opening at ``text[i] == '{'``.

    Returns:
        ``({key: (value_start, value_end or None)}, object_end or None)``; a key shows up once its
        value has started; ends are exclusive; None = not complete yet.
    Raises:
        Invalid: the text is not (the start of) a JSON object.
    """
    if text[i] != "{":
        raise Invalid(f"no object at {i}")
    fields: dict[str, tuple[int, int | None]] = {}
    j = skip_ws(text, i + 1)
    while j < len(text):
        c = text[j]
        if c == "}":
            return fields, j + 1
        if c == ",":
            j = skip_ws(text, j + 1)
            continue
        if c != '"':
            raise Invalid(f"expected a key at {j}, found {c!r}")
        key_end = scan_string(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise Invalid(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = scan_value(text, j)
        fields[key] = (j, end)
        if end is None:
            break
        j = skip_ws(text, end)
    return fields, None
