"""Calibration and evaluation text, offline: no download, ever.

The default text is the English prose of the Python documentation that ships with every
CPython (``pydoc_data.topics``): code samples, grammar rules and headings are dropped, the
prose paragraphs of each topic kept. Topics are split deterministically (sorted names, every
second one) into a calibration part and a held-out evaluation part, so perplexity is never
measured on text the quantizer has seen. ``--calib PATH`` takes a ``.txt`` file or a ``.jsonl``
file whose lines are objects with a ``text`` field.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any, Literal

EVAL_EVERY = 2  # topic i (in sorted order) is held out for evaluation when i % EVAL_EVERY == EVAL_EVERY - 1
_RULE = re.compile(r"^[*=\-~^\"]{3,}\s*$")


def _is_prose(paragraph: str) -> bool:
    """A dedented paragraph of English sentences (not code, grammar, a heading or a table)."""
    lines = paragraph.splitlines()
    if not lines or any(_RULE.match(line) for line in lines):
        return False  # heading underline or table rule
    if "::=" in paragraph or ">>>" in paragraph or "...." in paragraph:
        return False  # grammar, doctest, table
    body = " ".join(paragraph.split())
    words = body.split()
    symbols = sum(c in "()[]{}=_<>;#|\\@%" for c in body)
    letters = sum(c.isalpha() or c == " " for c in body)
    return (
        len(words) >= 6
        and letters >= 0.8 * len(body)
        and symbols <= 0.03 * len(body)
        and body[-1] in ".:!?)"
    )


def _topic_paragraphs(text: str) -> list[str]:
    out: list[str] = []
    for raw in re.split(r"\n\s*\n", text):
        p = textwrap.dedent(raw.strip("\n"))
        p = re.sub(r"^\* ", "", p)  # list bullet
        if _is_prose(p):
            out.append(" ".join(p.split()))
    return out


def builtin_split() -> tuple[str, str]:
    """The built-in text as ``(calibration, evaluation)`` strings (disjoint, deterministic).

    Some topics repeat paragraphs of others: every paragraph is kept once only (its first
    occurrence in sorted topic order), so no held-out paragraph is in the calibration part.
    """
    from pydoc_data.topics import topics

    calib: list[str] = []
    held_out: list[str] = []
    seen: set[str] = set()
    for i, name in enumerate(sorted(topics)):
        fresh = [p for p in _topic_paragraphs(topics[name]) if p not in seen]
        seen.update(fresh)
        if fresh:
            (held_out if i % EVAL_EVERY == EVAL_EVERY - 1 else calib).append("\n\n".join(fresh))
    return "\n\n".join(calib), "\n\n".join(held_out)


def read_text_file(path: str | Path) -> str:
    """Read a ``.txt`` file, or a ``.jsonl`` file's ``text`` fields joined by blank lines.

    Raises:
        FileNotFoundError: no such file.
        ValueError: another extension, bad JSON lines, no ``text`` field, or no text at all.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"calibration/evaluation text file not found: {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix == ".txt":
        text = p.read_text(encoding="utf-8", errors="replace")
    elif suffix == ".jsonl":
        parts: list[str] = []
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{p}:{lineno}: each line must be an object with a string field 'text'")  # noqa: TRY004
            parts.append(obj["text"])
        text = "\n\n".join(parts)
    else:
        raise ValueError(f"{p}: calibration text must be a .txt or .jsonl file (field 'text'), got {suffix!r}")
    if not text.strip():
        raise ValueError(f"{p}: the file holds no text")
    return text


def get_text(source: str | None, part: Literal["calib", "eval"]) -> str:
    """``source`` None -> the built-in part; a path -> that file's text (whatever ``part``)."""
    if source is None:
        calib, held_out = builtin_split()
        return calib if part == "calib" else held_out
    return read_text_file(source)


def calibration_samples(
    tokenizer: Any, source: str | None, num_samples: int, seq_len: int
) -> list[list[int]]:
    """Token windows for calibration.

    The text is tokenized as one stream (no special tokens) and cut into non-overlapping
    windows of ``seq_len`` tokens; when there are more windows than ``num_samples``, evenly
    spaced ones are taken (deterministic).

    Returns:
        ``min(num_samples, available)`` lists of ``seq_len`` token ids.
    Raises:
        ValueError: the text is shorter than one window (naming the token count and what to do).
    """
    text = get_text(source, "calib")
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    n_windows = len(ids) // seq_len
    where = source or "the built-in calibration text"
    if n_windows < 1:
        raise ValueError(
            f"{where} is too short: {len(ids)} tokens, need at least one window of --seq-len {seq_len} tokens "
            f"(ideally num_samples x seq_len = {num_samples * seq_len}); give a longer text or a smaller --seq-len"
        )
    take = min(num_samples, n_windows)
    starts = [round(i * (n_windows - 1) / max(take - 1, 1)) * seq_len for i in range(take)] if take > 1 else [0]
    return [ids[s : s + seq_len] for s in starts]
