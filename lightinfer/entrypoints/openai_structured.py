"""The structured-output fields of an API request -> one :class:`StructuredOutputs`, each error a 400 that
names the field the client sent.

Accepted (one of them per request):

* OpenAI: ``response_format`` ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` (the schema is
  enforced whatever ``strict`` says);
* vLLM's extras: ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice``
  (a list of strings), ``guided_grammar`` (Lark or GBNF), and their successor ``structured_outputs``
  (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``). ``guided_decoding_backend`` and
  ``guided_whitespace_pattern`` are ignored (one backend: llguidance; JSON whitespace is bounded).
"""

from __future__ import annotations

from typing import Any

from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.structured.spec import StructuredOutputs, StructuredOutputsError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _bad(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{field}: {message}", param=field)


def _response_format(value: Any) -> tuple[str, dict[str, Any]] | None:
    """``response_format`` as ``(field, StructuredOutputs kwargs)``, None for ``{"type": "text"}``."""
    if not isinstance(value, dict):
        raise _bad("response_format", "must be an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind != "json_schema":
        raise _bad("response_format.type", f"must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object {\"name\", \"schema\", \"strict\"}")
    if "schema" not in spec:
        raise _bad("response_format.json_schema.schema", "is required: the JSON Schema the reply must match")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise _bad("response_format.json_schema.strict", "must be true or false")
    return "response_format.json_schema.schema", {"json": spec["schema"]}


def structured_outputs_of(req: Any) -> tuple[StructuredOutputs | None, str | None]:
    """The request's constraint and the field it came from (None, None when there is none).

    Raises:
        OpenAIError: 400 naming the field: several constraints at once, a malformed ``response_format``,
            or what :class:`StructuredOutputs` refuses (an invalid JSON Schema, a keyword the library
            cannot enforce, a regex or grammar that does not compile, an empty choice).
    """
    given: list[tuple[str, dict[str, Any]]] = []
    if getattr(req, "response_format", None) is not None:
        rf = _response_format(req.response_format)
        if rf is not None:
            given.append(rf)
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, {kind: value}))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs", "must be an object such as {\"json\": schema}")
        unknown = sorted(set(so) - set(_KINDS))
        if unknown:
            raise _bad("structured_outputs", f"unknown key(s) {unknown}; use one of {', '.join(_KINDS)}")
        present = {k: v for k, v in so.items() if v is not None and v is not False}
        if len(present) != 1:
            raise _bad("structured_outputs", f"set exactly one of {', '.join(_KINDS)}")
        (kind, value), = present.items()
        given.append((f"structured_outputs.{kind}", {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        names = " and ".join(field.split(".")[0] for field, _ in given)
        raise _bad(given[1][0].split(".")[0], f"only one output constraint per request: got {names}")
    field, kwargs = given[0]
    try:
        return StructuredOutputs(**kwargs), field
    except StructuredOutputsError as e:
        raise _bad(field, e.reason) from None


def structured_error(exc: StructuredOutputsError, field: str | None) -> OpenAIError:
    """A constraint the engine's tokenizer cannot take (found when compiling it) as a 400 on ``field``."""
    return _bad(field or "structured_outputs", exc.reason)
