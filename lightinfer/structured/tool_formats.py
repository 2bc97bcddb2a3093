"""The tool-call formats models are trained on, and which one a chat template speaks.

========== ===================================================== =====================================
name       a call in the model's output                          models
========== ===================================================== =====================================
hermes     ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n``  Qwen2.5 / Qwen3, Hermes 2/3, SmolLM3
           ``</tool_call>``, one block per call, ``\\n`` between
llama3_json ``{"name": ..., "parameters": {...}}``, optionally     Llama 3.1 / 3.2 / 3.3
           after ``<|python_tag|>``; parallel calls joined by
           ``; ``
mistral    ``[TOOL_CALLS] [{"name": ..., "arguments": {...}},    Mistral 7B v0.3, Nemo, Small
           ...]``
========== ===================================================== =====================================

:func:`detect_tool_call_format` picks one from the chat template (or an explicit ``--tool-call-parser``
name); a template that shows none of them gets ``hermes``, the format lightinfer's fallback tool
prompt teaches (most small instruct models follow it best).
"""

from __future__ import annotations

from dataclasses import dataclass

FALLBACK_FORMAT = "hermes"


@dataclass(frozen=True)
class ToolCallFormat:
    """How one format frames calls.

    Attributes:
        name: the parser name (vLLM's ``--tool-call-parser`` names).
        start: text that opens the tool-call part of the output (None: a call is a bare JSON object at
            the start of the output).
        arguments_key: the key holding the arguments ("arguments" or Llama's "parameters").
        prefix: an optional token before the calls (Llama's ``<|python_tag|>``).
    """

    name: str
    start: str | None
    arguments_key: str
    prefix: str | None = None
    call_end: str | None = None  # closes each call (Hermes' </tool_call>)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "arguments", call_end="</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", None, "parameters", prefix="<|python_tag|>"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "arguments"),
}
ALIASES = {"qwen": "hermes", "qwen2": "hermes", "qwen2.5": "hermes", "qwen25": "hermes", "qwen3": "hermes",
           "llama3": "llama3_json", "llama": "llama3_json", "llama3.1": "llama3_json", "llama3.2": "llama3_json",
           "llama3_2": "llama3_json", "mistral_v3": "mistral"}


def get_tool_call_format(name: str) -> ToolCallFormat:
    """The format called ``name`` (a name of :data:`FORMATS` or an alias such as "qwen", "llama3").

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        known = ", ".join(sorted(FORMATS)) + " (aliases: " + ", ".join(sorted(ALIASES)) + ")"
        raise ValueError(f"tool-call parser {name!r} is unknown; use one of {known}")
    return FORMATS[key]


def detect_tool_call_format(chat_template: str | None, override: str | None = None) -> ToolCallFormat:
    """The tool-call format of a chat template, or the one named by ``override``.

    Detection (first match wins): ``<tool_call>`` -> hermes; ``[TOOL_CALLS]`` -> mistral;
    ``<|python_tag|>``, or ``"parameters"`` together with Llama 3's ``<|start_header_id|>`` / ``ipython``
    role -> llama3_json; otherwise :data:`FALLBACK_FORMAT`.

    Args:
        chat_template: the Jinja source (``tokenizer.chat_template``); None or "" -> fallback.
        override: an explicit format name (``--tool-call-parser``), which wins.
    Raises:
        ValueError: ``override`` is not a known format.
    """
    if override:
        return get_tool_call_format(override)
    t = chat_template or ""
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<|python_tag|>" in t or ("parameters" in t and ("<|start_header_id|>" in t or "ipython" in t)):
        return FORMATS["llama3_json"]
    return FORMATS[FALLBACK_FORMAT]
