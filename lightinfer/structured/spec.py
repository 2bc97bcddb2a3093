"""What a request constrains its output to: :class:`StructuredOutputs`, validated up front.

Every check runs when the object is built, before any tokenizer or generation is involved, so that a
server can answer a bad request with a 400 that names the field: a JSON Schema that is not valid JSON
Schema (checked against its meta-schema with ``jsonschema``), a keyword the grammar library cannot
enforce (reported, never silently ignored), a regex or grammar that does not compile, an empty choice.
"""

from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance

# Whitespace the JSON grammar allows between tokens: nothing, one space, or a newline and up to 20
# spaces/tabs of indentation (llama.cpp's JSON-schema grammars bound it the same way). Compact and
# pretty-printed JSON both pass; unbounded whitespace would let a small model loop on blank lines
# until max_tokens and return unfinished JSON.
JSON_WHITESPACE = r"(?:[ ]|\n[ \t]{0,20})?"
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE}

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A structured-output request the engine cannot honour; ``field`` names the offending field
    (``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``; callers may prefix their own path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"structured_outputs.{field}: {message}")
        self.field = field
        self.reason = message


def library_message(message: str) -> str:
    """llguidance's error text shortened to its cause (one line, no grammar dump)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error: "):
            return ln[len("error: "):]
    text = re.sub(r"^at \d+\(\d+\): ", "", lines[0] if lines else message)
    return text[:300]


def check_llguidance_grammar(grammar: str, field_name: str) -> None:
    """Raise :class:`StructuredOutputsError` when llguidance rejects ``grammar`` (its serialized form).
    Unimplemented JSON-Schema keywords come back as one error naming them."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return
    msg = messages[0] if messages else "rejected by the grammar library"
    unimplemented = re.search(r"Unimplemented keys: \[([^\]]*)\]", msg)
    if unimplemented:
        keys = ", ".join(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        raise StructuredOutputsError(
            field_name, f"the schema uses keyword(s) that constrained decoding cannot enforce: {keys}. "
            "Remove them (and check the output yourself) or express the constraint another way")
    raise StructuredOutputsError(field_name, f"cannot be used for constrained decoding: {library_message(msg)}")


def check_json_schema(schema: Any, field_name: str) -> dict[str, Any]:
    """``schema`` (a dict, a JSON string, or a pydantic model class) as a dict that is valid JSON Schema
    (its own ``$schema`` draft, else 2020-12), or :class:`StructuredOutputsError` naming ``field_name``."""
    import jsonschema

    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    elif isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as e:
            raise StructuredOutputsError(field_name, f"is a string but not JSON ({e}); pass a JSON Schema "
                                                     "object") from None
    if not isinstance(schema, dict):
        raise StructuredOutputsError(field_name, f"must be a JSON Schema object (a dict, a JSON string or a "
                                                 f"pydantic model class), got {type(schema).__name__}")
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise StructuredOutputsError(field_name, f"is not a valid JSON Schema: {e.message}"
                                                 + (f" (at {where})" if where else "")) from None
    return schema


def json_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of a JSON Schema with lightinfer's whitespace policy."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON escapes, which llguidance's Lark reads)."""
    return _json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """Constraint on a completion's text; set exactly one field (vLLM's ``structured_outputs`` names).

    Attributes:
        json: a JSON Schema: a dict, a JSON string, or a pydantic model class (its
            ``model_json_schema()``). Draft 2020-12 unless the schema's ``$schema`` says otherwise.
            Properties come out in the schema's order; whitespace per :data:`JSON_WHITESPACE`.
        json_object: True for any JSON object (OpenAI's ``{"type": "json_object"}``).
        regex: the whole output matches this regular expression (Rust ``regex`` syntax, as
            llguidance reads it: no look-around, no backreferences; ``\\d`` and ``\\w`` are the ASCII
            classes ``[0-9]`` and ``[0-9A-Za-z_]``, as in JSON Schema patterns).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar: llguidance's Lark dialect (rule ``start``; terminals in
            UPPER case or ``/regex/``; ``%json {schema}`` inlines a JSON Schema; ``<|name|>`` or
            ``<[id]>`` match a special token), or a GBNF grammar as llama.cpp reads it
            (``root ::= ...``), converted to Lark.

    Raises:
        StructuredOutputsError (a ValueError) naming the field: none or several fields set, a value of
        the wrong type, an invalid JSON Schema, a keyword the grammar library cannot enforce, a regex
        or grammar that does not compile, an empty choice or a choice that is not a list of strings.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    _llguidance: str = field(default="", init=False, repr=False, compare=False)
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise StructuredOutputsError(
                "/".join(given) if given else "json",
                f"set exactly one of {', '.join(_KINDS)} (got {', '.join(given) if given else 'none'})")
        kind = given[0]
        if kind == "json":
            schema = check_json_schema(self.json, "json")
            object.__setattr__(self, "json", schema)
            text = _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            grammar = json_grammar(schema)
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputsError("json_object", f"must be true or false, got {self.json_object!r}")
            text, grammar = "", json_grammar({"type": "object"})
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise StructuredOutputsError("regex", "must be a non-empty string")
            # \d and \w as ASCII classes (JSON Schema / ECMAScript meaning, what "\d{3}" is written
            # for); the Rust regex default would also admit e.g. Devanagari digits
            lark = f"start: /{llguidance.regex_to_lark(self.regex, 'dw')}/"
            text, grammar = self.regex, llguidance.LLMatcher.grammar_from_lark(lark)
        elif kind == "choice":
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise StructuredOutputsError("choice", "must be a non-empty list of strings")
            bad = [c for c in choice if not isinstance(c, str)]
            if bad:
                raise StructuredOutputsError("choice", f"must hold only strings, got {bad[0]!r}")
            object.__setattr__(self, "choice", tuple(choice))
            text = _json.dumps(list(choice), ensure_ascii=False)
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(c) for c in choice))
        else:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise StructuredOutputsError("grammar", "must be a non-empty grammar string (Lark or GBNF)")
            try:
                grammar = llguidance.grammar_from("grammar", self.grammar)
            except ValueError as e:
                raise StructuredOutputsError("grammar", f"cannot be read: {library_message(str(e))}") from None
            text = self.grammar
        check_llguidance_grammar(grammar, kind)
        object.__setattr__(self, "_llguidance", grammar)
        object.__setattr__(self, "_key", f"{kind}\x00{text}")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._key.split("\x00", 1)[0]

    @property
    def key(self) -> str:
        """A string that identifies the constraint (the compile cache's key)."""
        return self._key

    @property
    def llguidance_grammar(self) -> str:
        """The serialized llguidance grammar (what :class:`~lightinfer.structured.GrammarBackend` compiles)."""
        return self._llguidance

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputs) and other._key == self._key
