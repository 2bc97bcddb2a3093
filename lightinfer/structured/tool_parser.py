"""Read tool calls back from a model's text: whole (:func:`parse_tool_calls`) or streamed
(:class:`ToolCallStreamParser`, OpenAI delta shapes). The whole-text parse runs the streaming parser
over the text, so the streamed pieces always assemble to the same calls.

A call's ``arguments`` is the raw JSON text of the model's arguments object (a JSON string value is
decoded once), so it can be streamed as it is generated. Content is the text outside the call blocks,
with leading/trailing whitespace dropped (None when nothing is left).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightinfer.structured.tool_formats import ToolCallFormat, get_tool_call_format
from lightinfer.structured.tool_json import Invalid, scan_object, skip_ws
from lightinfer.structured.tool_spec import make_tool_call_id


@dataclass
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedToolCalls:
    """``content`` (None when empty) and the complete ``tool_calls``, in order."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class _Call:
    start: int  # index of the call object's "{" in the text
    index: int
    id: str | None = None
    name: str | None = None
    sent: int = 0  # characters of the arguments already streamed
    arguments: str | None = None  # set when the object is complete


class ToolCallStreamParser:
    """Incremental parser: :meth:`feed` each new piece of text, then :meth:`finish`.

    Each returns OpenAI ``delta`` dicts in order: ``{"content": str}``, a call's first delta
    ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}``,
    then ``{"tool_calls": [{"index", "function": {"arguments": piece}}]}``. Text that might be the
    start of a call marker is held back until it is decided.

    Args:
        fmt: the format name or :class:`ToolCallFormat`.
        id_factory: makes each call's id (default :func:`make_tool_call_id` for the format).
    """

    def __init__(self, fmt: str | ToolCallFormat, id_factory: Callable[[], str] | None = None) -> None:
        self.fmt = fmt if isinstance(fmt, ToolCallFormat) else get_tool_call_format(fmt)
        self._new_id = id_factory or (lambda: make_tool_call_id(self.fmt.name))
        self.text = ""
        self.pos = 0  # text before this index is decided
        self.phase = "start" if self.fmt.start is None else "content"  # start | content | calls | text
        self.calls: list[_Call] = []
        self._cur: _Call | None = None
        self._ws = ""  # whitespace held until more content shows it is inner
        self._content_started = False
        self._out: list[dict[str, Any]] = []
        self.content = ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far (non-empty at the end -> finish_reason "tool_calls")."""
        return [ToolCall(c.id or "", c.name or "", c.arguments) for c in self.calls if c.arguments is not None]

    # -- output -------------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if not text:
            return
        if not text.strip():
            if self._content_started:
                self._ws += text
            return
        if not self._content_started:
            text = text.lstrip()
            self._content_started = True
        body, self._ws = self._ws + text.rstrip(), text[len(text.rstrip()):]
        self.content += body
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += body
        else:
            self._out.append({"content": body})

    def _call_delta(self, call: _Call, piece: str | None = None) -> None:
        if piece is None:
            self._out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                              "function": {"name": call.name, "arguments": ""}}]})
            return
        last = self._out[-1] if self._out else None
        tc = last.get("tool_calls") if last else None
        if tc and tc[0]["index"] == call.index:
            tc[0]["function"]["arguments"] += piece
        else:
            self._out.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})

    # -- driving ------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Add newly generated text; returns the deltas it decides."""
        self.text += text
        self._advance(final=False)
        out, self._out = self._out, []
        return out

    def finish(self) -> list[dict[str, Any]]:
        """End of generation: release held-back text; returns the last deltas."""
        self._advance(final=True)
        out, self._out = self._out, []
        return out

    def _advance(self, final: bool) -> None:
        while True:
            before = (self.phase, self.pos, self._cur)
            if self.phase == "start":
                self._start(final)
            elif self.phase == "content":
                self._scan_content(final)
            elif self.phase == "calls":
                self._scan_calls(final)
            else:
                self._content(self.text[self.pos:])
                self.pos = len(self.text)
            if (self.phase, self.pos, self._cur) == before:
                return

    def _start(self, final: bool) -> None:
        """Llama-style: the output is calls when it opens with the prefix token or with "{"."""
        i = skip_ws(self.text, self.pos)
        rest, prefix = self.text[i:], self.fmt.prefix or ""
        if prefix and rest.startswith(prefix):
            self.pos, self.phase = i + len(prefix), "calls"
        elif rest.startswith("{"):
            self.pos, self.phase = i, "calls"
        elif rest and not (prefix and prefix.startswith(rest)) or final:
            self.phase = "text"

    def _scan_content(self, final: bool) -> None:
        marker = self.fmt.start or ""
        k = self.text.find(marker, self.pos)
        if k >= 0:
            self._content(self.text[self.pos:k])
            self.pos, self.phase = k + len(marker), "calls"
            return
        end = len(self.text)
        if not final:  # hold back a tail that could still grow into the marker
            for n in range(min(len(marker) - 1, end - self.pos), 0, -1):
                if marker.startswith(self.text[end - n:]):
                    end -= n
                    break
        self._content(self.text[self.pos:end])
        self.pos = end

    def _scan_calls(self, final: bool) -> None:
        t = self.text
        if self._cur is not None:
            self._scan_call(final)
            return
        i = skip_ws(t, self.pos)
        if i >= len(t):
            return
        c = t[i]
        name = self.fmt.name
        if c == "{":
            self._cur = _Call(start=i, index=len(self.calls))
            self.pos = i
        elif name == "mistral" and c in "[," or name == "llama3_json" and c == ";":
            self.pos = i + 1
        elif name == "hermes" and self.fmt.call_end and t.startswith(self.fmt.call_end, i):
            self.pos, self.phase = i + len(self.fmt.call_end), "content"
        elif name == "hermes" and self.fmt.call_end.startswith(t[i:]) and not final:
            return  # a partial </tool_call>
        else:  # the calls are over ("]" closes Mistral's list): the rest is text
            if name == "mistral" and c == "]":
                i += 1
            self.pos, self.phase = i, "content" if name == "hermes" else "text"

    def _scan_call(self, final: bool) -> None:
        call, t = self._cur, self.text
        assert call is not None
        try:
            fields, end = scan_object(t, call.start)
        except Invalid:
            return self._abandon()
        if call.name is None and "name" in fields and fields["name"][1] is not None:
            vs, ve = fields["name"]
            name = json.loads(t[vs:ve])
            if not isinstance(name, str):
                return self._abandon()
            call.name, call.id = name, self._new_id()
            self.calls.append(call)
            self._call_delta(call)
        key = next((k for k in (self.fmt.arguments_key, "arguments", "parameters") if k in fields), None)
        if call.name is not None and key is not None:
            vs, ve = fields[key]
            if t[vs] != '"':  # stream the raw JSON text as it grows
                piece = t[vs + call.sent: len(t) if ve is None else ve]
                if piece:
                    call.sent += len(piece)
                    self._call_delta(call, piece)
            elif ve is not None and not call.sent:  # arguments given as a JSON string: decode once
                decoded = json.loads(t[vs:ve])
                call.sent = len(decoded) or 1
                self._call_delta(call, decoded)
        if end is None:
            if final and call.name is None:
                return self._abandon()
            if final:  # cut off: the call stays unfinished (arguments None)
                self._cur = None
                self.pos, self.phase = len(t), "text"
            return
        if call.name is None:
            return self._abandon()
        if key is None:
            self._call_delta(call, "{}")
            call.arguments = "{}"
        else:
            vs, ve = fields[key]
            call.arguments = json.loads(t[vs:ve]) if t[vs] == '"' else t[vs:ve]
        self._cur, self.pos = None, end

    def _abandon(self) -> None:
        """Not a call after all (no name, broken JSON): everything from here on is text."""
        call = self._cur
        self._cur = None
        # an unnamed object becomes content; a named call that broke stays unfinished, skipped
        self.pos = call.start if call is not None and call.name is None else len(self.text)
        self.phase = "text"


def parse_tool_calls(text: str, fmt: str | ToolCallFormat,
                     id_factory: Callable[[], str] | None = None) -> ParsedToolCalls:
    """Split a finished completion into content and tool calls (the streaming parser, run whole).

    A call cut off before its end (``max_tokens``) is not returned as a call: its text is appended to
    the content, since its arguments are not valid JSON.
    """
    p = ToolCallStreamParser(fmt, id_factory)
    p.feed(text)
    p.finish()
    calls = p.tool_calls
    content = p.content
    unfinished = [c for c in p.calls if c.arguments is None]
    if unfinished:
        content = (content + "\n" if content else "") + text[unfinished[0].start:].strip()
    return ParsedToolCalls(content or None, calls)
