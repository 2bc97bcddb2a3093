"""Grammars that make tool calls valid by construction, in each model's own call format.

``tool_choice`` "required": the output is one call (or several when ``parallel_tool_calls``), nothing
else. A named function: exactly one call to it. "auto": free text, or (text then) calls; the text
cannot contain the call marker, so once a call starts it is completed validly. "none": no grammar.
Each call's arguments follow the tool's ``parameters`` schema; the function name comes first.

Reasoning models (Qwen3, QwQ, R1 distills) think first, in ``<think>...</think>``: with ``reasoning``
the reply may (``"optional"``) or must (``"open"``: the prompt already opened the block) start with that
block, then the answer as above, instead of cutting the thinking off (the forced call of "required") or
making the model spell out a ``<think>`` token that the text rule excludes ("auto").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightinfer.structured.spec import (
    JSON_OPTIONS,
    StructuredOutputs,
    StructuredOutputsError,
    bound_free_nesting,
    check_llguidance_grammar,
    close_objects,
    json_grammar,
    lark_literal,
)
from lightinfer.structured.tool_formats import ToolCallFormat, get_tool_call_format
from lightinfer.structured.tool_spec import ToolChoice, ToolSpec, parse_tool_choice, parse_tools

SpecialTokens = Mapping[str, int] | Callable[[str], "int | None"] | None
_REGEX_META = set("\\.+*?()|[]{}^$")


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _rebase_refs(node: Any, base: str) -> Any:
    """Local ``$ref`` pointers (``#...``) of a schema moved to ``#/$defs/<base>`` rewritten to follow it."""
    if isinstance(node, dict):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = f"#/$defs/{base}{ref[1:]}"
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _calls_schema(tools: Sequence[ToolSpec], key: str) -> dict[str, Any]:
    """One call object (name first, then arguments) for any of ``tools``; a tool schema with local
    ``$ref`` pointers is moved under the root's ``$defs`` so that its pointers still resolve."""
    defs: dict[str, Any] = {}
    calls = []
    for i, t in enumerate(tools):
        params = close_objects(copy.deepcopy(t.parameters))  # no invented argument names
        if _has_ref(params):
            base = f"tool_{i}_parameters"
            params.pop("$id", None)
            params.pop("$schema", None)
            defs[base] = _rebase_refs(params, base)
            params = {"$ref": f"#/$defs/{base}"}
        calls.append({"type": "object", "properties": {"name": {"const": t.name}, key: params},
                      "required": ["name", key], "additionalProperties": False})
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def _json_rule(schema: dict[str, Any]) -> str:
    """The ``%json`` rule of ``schema``: bounded whitespace, free argument values nested at most
    JSON_MAX_FREE_NESTING deep (numbers in tool arguments are not length-bounded: the number grammar
    guards whole-reply JSON only)."""
    schema = bound_free_nesting(schema)
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _token(text: str, special: SpecialTokens) -> str | None:
    """``<[id]>`` when ``text`` is a special token of the tokenizer, else None."""
    if special is None:
        return None
    tid = special.get(text) if isinstance(special, Mapping) else special(text)
    return None if tid is None else f"<[{int(tid)}]>"


def _auto_start(marker: str, marker_token: str | None, first_call_rest: str) -> list[str]:
    """"auto" for a format whose calls open with ``marker``: free text alone, or text then calls.

    A special-token marker can never occur inside a terminal, so ``TEXT`` simply stops where it comes.
    A text marker needs care: the lexer extends ``TEXT`` greedily, so ``TEXT`` excludes the marker and
    a lazy ``head`` lexeme (any text up to and including the first marker) opens the calls."""
    if marker_token is not None:
        return ["start: TEXT | calls | TEXT calls", "TEXT: /(?s:.+)/"]
    m = _regex_escape(marker)
    return [f"start: TEXT | head {first_call_rest}", f"head[lazy]: /(?s:.*){m}/",
            f"TEXT: /(?s:.+)/ & ~/(?s:.*){m}(?s:.*)/"]


REASONING_MODES = (None, "optional", "open")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _reasoning_start(mode: str, special: SpecialTokens) -> list[str]:
    """``start``: a ``<think>...</think>`` block (``mode`` "optional" or "open") then ``answer``."""
    open_tok, close_tok = _token(THINK_OPEN, special), _token(THINK_CLOSE, special)
    if close_tok is not None:  # a special token ends any text lexeme by itself
        lead = "" if mode == "open" else f"{open_tok or lark_literal(THINK_OPEN)} "
        think = [f"think: {lead}THOUGHT? {close_tok}", "THOUGHT: /(?s:.+)/"]
    else:  # lazy: the block ends at the first </think>
        lead = "" if mode == "open" else _regex_escape(THINK_OPEN)
        close = _regex_escape(THINK_CLOSE).replace("/", "\\/")  # "/" would end the Lark regex literal
        think = [f"think[lazy]: /{lead}(?s:.*){close}/"]
    start = "start: think GAP? answer" if mode == "open" else "start: answer | think GAP? answer"
    return [start, *think, r"GAP: /[ \t\r\n]+/"]


def _lark(fmt: ToolCallFormat, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool,
          special: SpecialTokens, reasoning: str | None = None) -> str:
    chosen = [t for t in tools if t.name == choice.name] if choice.mode == "named" else list(tools)
    many = parallel and choice.mode != "named"
    call_json = _json_rule(_calls_schema(chosen, fmt.arguments_key))
    if fmt.name == "hermes":
        open_tok, close_tok = _token(fmt.start, special), _token(fmt.call_end, special)
        more = " (\"\\n\" call)*" if many else ""
        lines = [f"call: {open_tok or lark_literal(fmt.start)} body",
                 f"body: \"\\n\" fn \"\\n\" {close_tok or lark_literal(fmt.call_end)}",
                 f"fn: {call_json}", f"calls: call{more}"]
        auto = _auto_start(fmt.start, open_tok, f"body{more}")
    elif fmt.name == "mistral":
        marker = _token(fmt.start, special)
        array = _calls_schema(chosen, fmt.arguments_key)
        defs = array.pop("$defs", None)
        array_schema: dict[str, Any] = {"type": "array", "items": array, "minItems": 1}
        if not many:
            array_schema["maxItems"] = 1
        if defs:
            array_schema["$defs"] = defs
        lines = [f"calls: {marker or lark_literal(fmt.start)} \" \"? fns", f"fns: {_json_rule(array_schema)}"]
        auto = _auto_start(fmt.start, marker, "\" \"? fns")
    else:  # llama3_json: bare JSON object(s), optionally after <|python_tag|>
        tag = _token(fmt.prefix, special) if fmt.prefix else None
        body = "call (\";\" \" \"? call)*" if many else "call"
        lines = [f"calls: {tag + '? ' if tag else ''}{body}", f"call: {call_json}"]
        # free text must not open with "{": that is a call
        auto = ["start: TEXT | calls", r"TEXT: /\s*[^{\s](?s:.*)/"]
    start = list(auto) if choice.mode == "auto" else ["start: calls"]
    if reasoning:  # the answer after a <think> block
        start = [start[0].replace("start:", "answer:", 1), *start[1:], *_reasoning_start(reasoning, special)]
    return "\n".join([*start, *lines]) + "\n"


def build_tool_call_grammar(tools: Sequence[Any] | None, tool_choice: Any = None, fmt: str | ToolCallFormat = "hermes",
                            parallel_tool_calls: bool = True, special_tokens: SpecialTokens = None,
                            reasoning: str | None = None) -> StructuredOutputs | None:
    """The constraint for a chat request with ``tools``, or None when nothing is constrained.

    Args:
        tools: OpenAI ``tools`` (or :class:`ToolSpec` objects); checked by :func:`parse_tools`.
        tool_choice: OpenAI ``tool_choice`` (None: "auto" with tools, else "none").
        fmt: the model's call format (a name or a :class:`ToolCallFormat`, see
            :func:`~lightinfer.structured.detect_tool_call_format`).
        parallel_tool_calls: allow several calls in one turn ("required" / "auto").
        special_tokens: the tokenizer's special tokens, as ``{text: id}`` or a lookup such as
            ``GrammarBackend.special_token_id``: markers that are special tokens (Mistral's
            ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``) are matched as those tokens, which the
            model was trained to emit, instead of as text.
        reasoning: None, "optional" (the reply may open with a ``<think>...</think>`` block: a template
            with thinking on) or "open" (the prompt ends inside ``<think>``: the reply closes it first).
    Returns:
        A :class:`StructuredOutputs` holding a Lark grammar, or None for "none" / "auto" without tools.
    Raises:
        ValueError: bad tools or tool_choice (naming the field), or a tool's parameters using a
            keyword constrained decoding cannot enforce (``tools[i].function.parameters``).
    """
    specs = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, specs)
    f = fmt if isinstance(fmt, ToolCallFormat) else get_tool_call_format(fmt)
    if reasoning not in REASONING_MODES:
        raise ValueError(f"reasoning must be one of {REASONING_MODES}, got {reasoning!r}")
    if choice.mode == "none" or not specs:
        return None
    for i, t in enumerate(specs):
        try:
            check_llguidance_grammar(json_grammar(t.parameters), "parameters")
        except StructuredOutputsError as e:
            raise ValueError(f"tools[{i}].function.parameters: {e.reason}") from None
    return StructuredOutputs(grammar=_lark(f, specs, choice, parallel_tool_calls, special_tokens, reasoning))


def with_answer_format(tool_grammar: StructuredOutputs, answer: StructuredOutputs) -> StructuredOutputs:
    """An "auto" tool grammar whose free-text answer must instead be JSON of the response format ``answer``: the
    reply is either that JSON or the tool calls (what an agent asks with tools and a response format together,
    e.g. Codex CLI's ``--output-schema``). A ``<think>`` block before either stays allowed.

    Args:
        tool_grammar: :func:`build_tool_call_grammar` of tool_choice "auto".
        answer: a ``json`` or ``json_object`` structured output.
    Returns:
        the combined constraint.
    Raises:
        ValueError: ``answer`` is not JSON (a regex, choice or grammar cannot be combined with calls).
    """
    kind = answer.kind
    if kind not in ("json", "json_object"):
        raise ValueError(f"a {kind} constraint cannot be combined with tool calls; only a JSON response format can")
    schema = answer.json if kind == "json" else {"type": "object"}
    first, *rest = (tool_grammar.grammar or "").splitlines()
    head = first.split(":", 1)[0]  # "start", or "answer" when a <think> block may come first
    reply = _json_rule(close_objects(copy.deepcopy(schema)))
    return StructuredOutputs(grammar="\n".join([f"{head}: reply_json | calls", f"reply_json: {reply}", *rest]) + "\n")
