"""OpenAI ``tools`` / ``tool_choice`` read and checked: what the grammar builders and parsers take.

Bad input raises ValueError naming the field the way a 400 should (``tools[1].type``,
``tool_choice.function.name``, ...), before any generation.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightinfer.structured.spec import StructuredOutputsError, check_json_schema

# OpenAI's rule for function names
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# A tool without "parameters" takes no arguments (OpenAI: "omitting parameters defines a function
# with an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    """One callable function: ``name``, ``description`` and its JSON-Schema ``parameters``."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))
    description: str = ""


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` "none" / "auto" / "required" / "named" (then ``name`` is the forced function)."""

    mode: ToolChoiceMode
    name: str | None = None


def parse_tools(tools: Sequence[Any] | None) -> list[ToolSpec]:
    """OpenAI ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``,
    or :class:`ToolSpec` objects) as ToolSpecs.

    Raises:
        ValueError: naming the field: not a list, a type other than "function", a missing or badly
            formed name, a duplicate name, parameters that are not a valid JSON Schema object.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools: must be a list of tools, got {type(tools).__name__}")  # noqa: TRY004
    out: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, ToolSpec):
            out.append(tool)
            continue
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: must be an object like {{\"type\": \"function\", \"function\": {{...}}}}")  # noqa: TRY004
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type: only \"function\" tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object with a name (and parameters)")  # noqa: TRY004
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ValueError(f"{where}.function.description: must be a string")  # noqa: TRY004
        params = fn.get("parameters")
        if params is None:
            params = dict(NO_PARAMETERS)
        else:
            try:
                params = check_json_schema(params, "parameters")
            except StructuredOutputsError as e:
                raise ValueError(f"{where}.function.parameters: {e.reason}") from None
        out.append(ToolSpec(name=name, parameters=params, description=desc))
    seen: set[str] = set()
    for i, t in enumerate(out):
        if t.name in seen:
            raise ValueError(f"tools[{i}].function.name: {t.name!r} is defined twice")
        seen.add(t.name)
    return out


def parse_tool_choice(tool_choice: Any, tools: Sequence[ToolSpec]) -> ToolChoice:
    """OpenAI ``tool_choice`` checked against ``tools``. None means "auto" when there are tools, else
    "none" (OpenAI's defaults).

    Raises:
        ValueError: an unknown string, a malformed object, a named function that is not in ``tools``,
            or "required"/named with no tools.
    """
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: must be \"none\", \"auto\", \"required\" or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice: \"required\" needs at least one tool in tools")
        return ToolChoice(tool_choice)  # type: ignore[arg-type]
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError("tool_choice: an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name: must be the name of one of the tools")  # noqa: TRY004
    if name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools) or "none"
        raise ValueError(f"tool_choice.function.name: {name!r} is not in tools (defined: {known})")
    return ToolChoice("named", name)


_ALNUM = string.ascii_letters + string.digits


def make_tool_call_id(fmt: str = "hermes") -> str:
    """A new tool-call id: ``call_`` + 24 random letters/digits (OpenAI's shape), or 9 letters/digits for
    the Mistral format (its chat templates refuse other ids)."""
    n = 9 if fmt == "mistral" else 24
    body = "".join(secrets.choice(_ALNUM) for _ in range(n))
    return body if fmt == "mistral" else f"call_{body}"
