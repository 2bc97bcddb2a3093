"""What the chat UI says about a reply: the history it sends to the model, its notes (stats, notices) and the
numbers of a reply that was stopped.

Notes are assistant messages with an empty content and a ``metadata`` title (Gradio shows them as a small
collapsible line under the reply) tagged with :data:`STATS_TAG`, so they are never sent to the model. They
carry no ``status``: Gradio reads a last message with ``status: "done"`` as a finished "thought" with more
to come and draws a "•••" bubble under it while any later reply streams.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

STATS_TAG = "lightinfer-stats"  # metadata id of our own notes, which are never sent to the model
# metadata id of a note that refused the user message before it (too long, a bad setting): that message is
# never sent to the model either, or every later turn would carry it (and push the real conversation out)
REFUSED_TAG = "lightinfer-refused"
MAX_UI_SEED = 2**63  # as the OpenAI API takes it


def content_text(content: Any) -> str:
    """A history entry's content as text: a string, or Gradio 6's list of blocks (text parts kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(content_text(part) for part in content)
    return ""  # files, components: nothing the text model can read


def _as_dict(msg: Any) -> dict[str, Any]:
    """A history entry (a dict, or a ``gr.ChatMessage``) as a dict."""
    return msg if isinstance(msg, dict) else getattr(msg, "__dict__", {})


def _note_id(msg: Any) -> str | None:
    meta = _as_dict(msg).get("metadata") or {}
    return meta.get("id") if isinstance(meta, dict) else None


def is_note(msg: Any) -> bool:
    """Whether a history entry is one of our notes (stats, notices, refusals)."""
    return _note_id(msg) in (STATS_TAG, REFUSED_TAG)


def history_messages(history: list[Any]) -> list[dict[str, str]]:
    """Gradio chat history -> ``[{"role", "content"}]`` without our notes, without a user message a
    :func:`refusal` answered, and without the replies to an empty user message (which alone would leave two
    assistant turns in a row)."""
    out: list[dict[str, str]] = []
    skipping_replies = False
    for msg in history:
        tag = _note_id(msg)
        if tag == REFUSED_TAG and out and out[-1]["role"] == "user":
            out.pop()
        if tag in (STATS_TAG, REFUSED_TAG):
            continue
        m = _as_dict(msg)
        role, text = m.get("role"), content_text(m.get("content"))
        if role == "user":
            skipping_replies = not text
        if role in ("user", "assistant") and text and not (role == "assistant" and skipping_replies):
            out.append({"role": role, "content": text})
    return out


def note(text: str, tag: str = STATS_TAG) -> gr.ChatMessage:
    """A note under the reply (see the module docstring for why it has no status)."""
    return gr.ChatMessage(role="assistant", content="", metadata={"title": text, "id": tag})


def refusal(text: str) -> gr.ChatMessage:
    """A note saying why the user message before it was not answered; that message is then left out of the
    history the model sees (:func:`history_messages`)."""
    return note(text, REFUSED_TAG)


def ui_seed(value: Any) -> int | None:
    """The seed box's value as a sampling seed: a negative number (or none) is random (None).

    Raises:
        ValueError: not a whole number, not finite, or 2**63 and beyond (e.g. 1e30), with what is accepted.
    """
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"the seed must be a whole number (-1 = random), got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"the seed must be a whole number (-1 = random), got {value!r}")
    seed = int(value) if isinstance(value, int) else int(number)
    if seed >= MAX_UI_SEED:
        raise ValueError(f"the seed must be below 2**63 = {MAX_UI_SEED:,} (-1 = random), got {value!r}")
    return seed if seed >= 0 else None


@dataclass
class ReplyProgress:
    """One reply's timing (``time.monotonic()`` seconds) and length, for its stats line."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None  # when the first token arrived
    num_tokens: int = 0
    drafted: int = 0  # speculative decoding: draft tokens verified for this reply, and accepted
    accepted: int = 0
    ended: bool = False  # the reply's generator has finished, normally or not
    stopped: bool = False  # it ended before the engine finished it (Stop, a closed tab)

    def update(self, num_tokens: int, drafted: int = 0, accepted: int = 0) -> None:
        if self.first is None and num_tokens:
            self.first = time.monotonic()
        self.num_tokens, self.drafted, self.accepted = num_tokens, drafted, accepted

    def stats(self) -> str:
        """``"N tokens · R tokens/s · time to first token T s"`` (the rate over the tokens after the first), and
        ``" · drafts accepted A/D"`` where speculative decoding verified drafts for it."""
        elapsed = time.monotonic() - (self.first or self.start)
        rate = (self.num_tokens - 1) / elapsed if self.first is not None and self.num_tokens > 1 and elapsed > 0 else 0.0
        ttft = f"{self.first - self.start:.2f} s" if self.first is not None else "–"
        drafts = f" · drafts accepted {self.accepted}/{self.drafted}" if self.drafted else ""
        return f"{self.num_tokens} tokens · {rate:.1f} tokens/s · time to first token {ttft}{drafts}"


class ReplyTracker:
    """The latest reply of each browser session, so that the Stop button's handler can show the numbers of
    the reply it stopped (the stopped generator itself can no longer update the chat)."""

    _KEEP_SECONDS = 120.0  # a stopped reply whose Stop handler never came (tab closed) is forgotten after this

    def __init__(self) -> None:
        self._by_session: dict[str, ReplyProgress] = {}

    def start(self, session: str | None) -> ReplyProgress:
        now = time.monotonic()
        for key in [k for k, p in self._by_session.items() if p.ended and now - p.start > self._KEEP_SECONDS]:
            del self._by_session[key]
        progress = ReplyProgress()
        if session:
            self._by_session[session] = progress
        return progress

    @staticmethod
    def end(progress: ReplyProgress, stopped: bool) -> None:
        progress.stopped, progress.ended = stopped, True

    async def stopped_stats(self, session: str | None, timeout: float = 3.0) -> str | None:
        """The stats of ``session``'s reply once its generator has ended, if it was stopped; None if it
        finished normally (its own last update showed the stats) or there is none."""
        progress = self._by_session.get(session or "")
        deadline = time.monotonic() + timeout
        while progress is not None and not progress.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # Gradio cancels the reply's task as this handler starts
        if progress is None or not progress.ended or not progress.stopped:
            return None
        self._by_session.pop(session or "", None)
        return progress.stats()


def json_schema_constraint(text: str | None) -> dict[str, Any] | None:
    """The sampling panel's "JSON schema" box as ``structured_outputs`` (None when blank).

    Raises:
        ValueError: the box holds no JSON, or a schema constrained decoding cannot take (the message says which).
    """
    if not text or not text.strip():
        return None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the JSON schema box does not hold JSON ({e})") from None
    from lightinfer.structured import StructuredOutputs

    return {"json": StructuredOutputs(json=schema).json}  # checked now: a bad schema is a note, not a failure


def format_json_reply(text: str) -> str:
    """A reply constrained by a JSON schema, pretty-printed in a ``json`` code block (as it is when it does
    not parse, e.g. cut off by the token limit)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return "```json\n" + json.dumps(value, indent=2, ensure_ascii=False) + "\n```"

