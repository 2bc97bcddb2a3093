"""Tool calls in a conversation: OpenAI's assistant ``tool_calls`` and ``role: "tool"`` messages checked
and shaped for chat templates, and the fallback for templates that know nothing of tools.

Templates that render ``tools`` (Qwen2.5/Qwen3, Llama 3.1+, Mistral, Hermes...) get the tools and the
history as transformers passes them (``tool_calls[j].function.arguments`` as a dict, which is what
their ``| tojson`` expects). A template that does not (SmolLM2's, plain ChatML) gets a system prompt that
teaches the call format the parser reads (:data:`FALLBACK_PROMPTS`), the assistant's earlier calls
written out in that format, and tool results as user turns in ``<tool_response>`` blocks (Hermes').
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from dataclasses import dataclass
from typing import Any

from lightinfer.inputs.data import InputError
from lightinfer.inputs.text import check_text, message_text
from lightinfer.sampling_params import SamplingParams
from lightinfer.structured.spec import StructuredOutputs
from lightinfer.structured.tool_formats import ToolCallFormat
from lightinfer.structured.tool_grammar import THINK_CLOSE, THINK_OPEN, with_answer_format
from lightinfer.structured.tool_parser import ParsedToolCalls, ToolCallStreamParser, parse_tool_calls
from lightinfer.structured.tool_spec import ToolChoice, ToolSpec

_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")

# How the model is told to call tools when its template has no tool section, per call format (the
# grammar and the parser expect the same shape). {tools}: one JSON tool definition per line.
FALLBACK_PROMPTS: dict[str, str] = {
    "hermes": (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "The functions are described as JSON signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
        "</tools>\n\nTo call a function, reply with a JSON object holding the function name and its arguments "
        "within <tool_call></tool_call> XML tags, one block per call:\n<tool_call>\n"
        "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"),
    "llama3_json": (
        "You have access to the following functions:\n\n{tools}\n\nTo call a function, reply with JSON only, in "
        "the format {{\"name\": function name, \"parameters\": dictionary of argument name and its value}}. "
        "Do not use variables."),
    "mistral": (
        "You have access to the following functions:\n\n{tools}\n\nTo call functions, reply with [TOOL_CALLS] "
        "followed by a JSON list of calls: [TOOL_CALLS] [{{\"name\": function name, \"arguments\": "
        "{{argument name: value}}}}]"),
}


def _field_error(where: str, message: str) -> InputError:
    return InputError(f"{where}: {message}", param=where)


def normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as templates read them: ``[{"id", "type": "function",
    "function": {"name", "arguments": dict}}]`` (``arguments`` given as a JSON string is decoded).

    Raises:
        InputError: naming the field (``messages[i].tool_calls[j].function.arguments`` ...).
    """
    if not isinstance(calls, list) or not calls:
        raise _field_error(where, "must be a non-empty list of {\"id\", \"type\": \"function\", \"function\": "
                                  "{\"name\", \"arguments\"}} objects (or left out)")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _field_error(at, "must be an object {\"id\", \"type\": \"function\", \"function\": {...}}")
        if call.get("type", "function") != "function":
            raise _field_error(f"{at}.type", f"only \"function\" calls are supported, got {call.get('type')!r}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise _field_error(f"{at}.id", "must be the call's id (a non-empty string)")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _field_error(f"{at}.function", "must be an object with the function's name and arguments")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise _field_error(f"{at}.function.arguments", f"is not valid JSON ({e})") from None
        if not isinstance(args, dict):
            raise _field_error(f"{at}.function.arguments", "must be a JSON object (or its JSON text)")
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def check_tool_message(m: dict[str, Any], i: int, calls: dict[str, str]) -> dict[str, Any]:
    """A ``role: "tool"`` message as templates read it: ``{"role": "tool", "content", "tool_call_id",
    "name"}`` (the name of the call it answers).

    Args:
        calls: id -> function name of every tool call in the earlier assistant messages.
    Raises:
        InputError: no ``tool_call_id``, or one that matches no earlier call (``messages[i].tool_call_id``).
    """
    call_id = m.get("tool_call_id")
    where = f"messages[{i}].tool_call_id"
    if not isinstance(call_id, str) or not call_id:
        raise _field_error(where, "a tool message needs the id of the tool call it answers")
    if call_id not in calls:
        known = ", ".join(repr(c) for c in calls) or "none"
        raise _field_error(where, f"{call_id!r} matches no tool call of an earlier assistant message "
                                  f"(known ids: {known})")
    content = m.get("content")
    text = content if isinstance(content, str) else json.dumps(content) if isinstance(content, dict) \
        else message_text(content)
    return {"role": "tool", "content": check_text(text, "a tool message"), "tool_call_id": call_id,
            "name": calls[call_id]}


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates take only 9-letter/digit ids: other ids map to a stable 9-character one."""
    if _MISTRAL_ID.match(call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_ALNUM[(digest >> (6 * k)) % len(_ALNUM)] for k in range(9))


def with_mistral_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every tool-call id in Mistral's shape (calls and tool results alike)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": mistral_call_id(c["id"])} for c in m["tool_calls"]]}
        elif m["role"] == "tool":
            m = {**m, "tool_call_id": mistral_call_id(m["tool_call_id"])}
        out.append(m)
    return out


def _write_call(fmt: ToolCallFormat, name: str, args: dict[str, Any]) -> str:
    body = json.dumps({"name": name, fmt.arguments_key: args}, ensure_ascii=False)
    if fmt.name == "hermes":
        return f"<tool_call>\n{body}\n</tool_call>"
    return body


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tool prompt in the system message
    (when ``tools``), earlier calls written out in ``fmt``, tool results as user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [_write_call(fmt, c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            if fmt.name == "mistral":
                calls = ["[TOOL_CALLS] [" + ", ".join(calls) + "]"]
            elif fmt.name == "llama3_json":
                calls = ["; ".join(calls)]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = FALLBACK_PROMPTS[fmt.name].format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


_PROBE_TOOL = "lightinfer_probe_tool"
_SUPPORT: dict[str, bool] = {}  # chat template source -> renders tools


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the ``tools`` it is given (checked once per template
    by rendering a probe conversation; a template that fails on it counts as not rendering tools)."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)
    if key not in _SUPPORT:
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool],
                                                 add_generation_prompt=True, tokenize=False)
            _SUPPORT[key] = isinstance(text, str) and _PROBE_TOOL in text
        except Exception:  # noqa: BLE001 -- any template error: treat as no tool support
            _SUPPORT[key] = False
    return _SUPPORT[key]


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's reply is read back when it may call tools (made by
    :meth:`lightinfer.inputs.InputProcessor.process_chat`).

    Attributes:
        format: the call format the model was told (and is constrained) to use.
        tools: the callable functions.
        choice: ``tool_choice`` ("auto", "required" or "named").
        grammar: the constraint on the reply (:func:`lightinfer.structured.build_tool_call_grammar`).
    """

    format: ToolCallFormat
    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    grammar: StructuredOutputs

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with the tool grammar as ``structured_outputs``, and special tokens kept in
        the text (Llama's ``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` are special tokens the parser
        must see; the grammar keeps every other special token out of the reply). With tool_choice "auto" a JSON
        response format already in ``params`` replaces the free-text answer: the reply is that JSON or calls
        (:func:`lightinfer.structured.tool_grammar.with_answer_format`).

        Raises:
            InputError: ``params`` has a response format the calls cannot be combined with (see
                :meth:`check_compatible`).
        """
        answer = params.structured_outputs
        self.check_compatible(answer)
        grammar = self.grammar if answer is None else with_answer_format(self.grammar, answer)
        return dataclasses.replace(params, structured_outputs=grammar, skip_special_tokens=False)

    def check_compatible(self, structured_outputs: StructuredOutputs | None) -> None:
        """Raise :class:`InputError` (``param="tool_choice"``) when the request also has a response format the
        reply cannot be constrained to beside the calls: any with tool_choice "required" or a named function (the
        reply must be a call), a regex, choice or grammar with "auto" (a JSON format is the answer's form)."""
        if structured_outputs is None:
            return
        if self.choice.mode != "auto":
            raise InputError(f"tool_choice {self.choice.mode!r} makes the reply a tool call, which cannot be combined "
                             "with a response format (response_format / structured_outputs): use tool_choice "
                             "\"auto\" (the reply is then the formatted answer or calls) or leave the response "
                             "format out", param="tool_choice")
        if structured_outputs.kind not in ("json", "json_object"):
            raise InputError(f"a {structured_outputs.kind} constraint cannot be combined with tool calls: with tools "
                             "only a JSON response format (json_schema or json_object) can shape the answer; set "
                             "tool_choice to \"none\" for this constraint", param="tool_choice")

    def stream_parser(self) -> ToolCallStreamParser:
        """A fresh streaming parser (one per completion) yielding OpenAI ``delta`` dicts."""
        return ToolCallStreamParser(self.format)

    def parse(self, text: str) -> ParsedToolCalls:
        """A finished completion split into content and calls."""
        return parse_tool_calls(text, self.format)


def reasoning_mode(chat_template: Any, prompt_text: str, chat_template_kwargs: dict[str, Any] | None) -> str | None:
    """Whether a forced tool call may come after a ``<think>`` block (see
    :func:`lightinfer.structured.build_tool_call_grammar`): "open" when the prompt ends inside one (R1
    distills, QwQ), "optional" when the template thinks and ``enable_thinking`` is not false (Qwen3),
    else None."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    thinking = isinstance(chat_template, str) and THINK_OPEN in chat_template
    if thinking and (chat_template_kwargs or {}).get("enable_thinking", True) is not False and \
            not tail.endswith(THINK_CLOSE):
        return "optional"
    return None
