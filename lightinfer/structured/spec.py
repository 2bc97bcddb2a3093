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

# How long a JSON number the grammar lets out: what a float64 carries. 17 significant digits round-trip
# any double and its exponent has at most 3 digits (1e-324 .. 1.8e308); an integer without fraction or
# exponent may have 19 digits (int64's length). A small model otherwise loops inside a number
# ("31.2389888888...") until max_tokens, as it did on whitespace. Values outside this (a 30-digit
# integer, 1e-400) cannot be generated; schemas rarely ask for them.
JSON_MAX_SIGNIFICANT_DIGITS = 17
JSON_MAX_EXPONENT_DIGITS = 3
JSON_MAX_INTEGER_DIGITS = 19
# Containers (objects, arrays) nested at most this deep where the schema leaves the value free
# (`json_object`, `{}` / `true` subschemas, an `"object"` or `"array"` without properties or items):
# deep enough for real data, and a small model that keeps opening `{"a": {` is made to close after a
# few dozen tokens instead of nesting until max_tokens. Nesting the schema spells out is not limited.
JSON_MAX_FREE_NESTING = 8


def _json_number_regex() -> str:
    """A JSON number with at most :data:`JSON_MAX_SIGNIFICANT_DIGITS` mantissa digits (a lone leading
    ``0`` aside: ``0.000123`` counts 6), an exponent of at most :data:`JSON_MAX_EXPONENT_DIGITS` digits,
    or an integer of at most :data:`JSON_MAX_INTEGER_DIGITS` digits."""
    sig, exp = JSON_MAX_SIGNIFICANT_DIGITS, JSON_MAX_EXPONENT_DIGITS
    forms = [rf"0(?:\.[0-9]{{1,{sig}}})?"]
    for n in range(1, sig + 1):  # n integer digits leave sig - n for the fraction
        frac = rf"(?:\.[0-9]{{1,{sig - n}}})?" if n < sig else ""
        forms.append(rf"[1-9][0-9]{{{n - 1}}}{frac}")
    mantissa = "|".join(forms)
    return (rf"-?(?:(?:{mantissa})(?:[eE][+-]?[0-9]{{1,{exp}}})?"
            rf"|[1-9][0-9]{{{sig},{JSON_MAX_INTEGER_DIGITS - 1}}})")


# Any JSON value whose numbers obey _json_number_regex, whatever the nesting. Compiled next to a JSON
# constraint, the two masks are ANDed (GrammarMatcher): llguidance's JSON-Schema compiler has no
# option for number length, and this keeps every schema keyword it enforces. Strings: any valid JSON
# string (a superset of what the schema grammar allows); whitespace: any (the schema grammar bounds it).
JSON_NUMBER_GUARD_LARK = r"""
%ignore /[ \t\n\r]+/
start: value
value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" (pair ("," pair)*)? "}"
pair: STRING ":" value
array: "[" (value ("," value)*)? "]"
STRING: /"(?:[^"\\\x00-\x1f]|\\[^\x00-\x1f])*"/
NUMBER: /""" + _json_number_regex() + "/\n"

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


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _has_key(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_has_key(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_has_key(v, key) for v in node)
    return False


def close_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that lists ``properties`` and says
    nothing about other keys: what the generated JSON may contain (always valid under ``schema``, which
    allows but never needs the extra keys). vLLM's default backend (xgrammar's strict mode) generates the
    same way; a small model given open objects invents keys until the token limit. Schemas using
    ``allOf`` or ``unevaluatedProperties`` stay as they are (closing a branch would refuse the other
    branches' properties)."""
    if _has_key(schema, "allOf") or _has_key(schema, "unevaluatedProperties"):
        return schema

    def close(node: Any) -> Any:
        if isinstance(node, list):
            return [close(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in ("const", "enum", "default", "examples") else close(v)) for k, v in node.items()}
        if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN_KEYS):
            out["additionalProperties"] = False
        return out

    return close(schema)


# Keywords that say nothing about a value: a schema made of only these accepts anything.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$defs", "definitions", "$anchor"})
_DEPTH_DEF = "lightinfer_free_json_depth_{}"
# Where a free subschema is replaced by a depth-bounded one; "not", "if", "contains", "propertyNames",
# "allOf" and "oneOf" entries keep their meaning only as they are.
_VALUE_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_VALUE_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_VALUE_LISTS = ("anyOf", "prefixItems", "items")
_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "not")


def _is_free(node: Any) -> bool:
    return node is True or (isinstance(node, dict) and all(k in _ANNOTATIONS for k in node))


def _has_nested_id(node: Any, top: bool = True) -> bool:
    if isinstance(node, dict):
        return (not top and "$id" in node) or any(_has_nested_id(v, False) for k, v in node.items()
                                                  if k not in ("const", "enum", "default", "examples"))
    if isinstance(node, list):
        return any(_has_nested_id(v, False) for v in node)
    return False


def bound_free_nesting(schema: Any, depth: int = JSON_MAX_FREE_NESTING) -> Any:
    """``schema`` with every part it leaves free limited to ``depth`` levels of containers (see
    :data:`JSON_MAX_FREE_NESTING`): a ``{}`` / ``true`` subschema in a value position becomes a
    reference to ``$defs`` holding "any JSON value nested at most ``depth`` deep"; an ``"object"``
    with no ``properties`` / ``additionalProperties`` / ``patternProperties`` gets values nested at
    most ``depth - 1`` deep (the object itself is a level), an ``"array"`` with no ``items`` likewise.
    Everything the schema spells out is kept. A schema with nested ``$id`` (its own URI bases, where a
    local reference would resolve elsewhere) is returned unchanged."""
    if _has_nested_id(schema) or depth < 1:
        return schema
    def ref(k: int) -> dict[str, str]:
        return {"$ref": f"#/$defs/{_DEPTH_DEF.format(k)}"}

    used = False

    def free(k: int) -> dict[str, Any]:
        nonlocal used
        used = True
        return ref(k)

    def walk(node: Any) -> Any:
        if _is_free(node):
            return free(depth) if node is True else {**node, **free(depth)}
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _VALUE_MAPS:
            if isinstance(node.get(key), dict):
                out[key] = {name: walk(sub) for name, sub in node[key].items()}
        for key in _VALUE_ONE:
            if isinstance(node.get(key), (dict, bool)):
                out[key] = walk(node[key])
        for key in _VALUE_LISTS:
            if isinstance(node.get(key), list):
                out[key] = [walk(sub) for sub in node[key]]
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if not any(k in node for k in _COMBINATORS):
            if "object" in types and not any(k in node for k in ("properties", *_OPEN_KEYS)):
                out["additionalProperties"] = free(depth - 1)
            if "array" in types and not any(k in node for k in ("items", "prefixItems", "additionalItems",
                                                                  "unevaluatedItems")):
                out["items"] = free(depth - 1)
        return out

    if _is_free(schema):  # the whole value is free: depth levels from the top
        top = dict(schema) if isinstance(schema, dict) else {}
        top.update(free(depth))
        out = top
    else:
        out = walk(schema)
    if not used:
        return schema
    scalars = ["null", "boolean", "number", "string"]
    defs = {_DEPTH_DEF.format(0): {"type": scalars}}
    for k in range(1, depth + 1):
        defs[_DEPTH_DEF.format(k)] = {"type": [*scalars, "array", "object"], "items": ref(k - 1),
                                      "additionalProperties": ref(k - 1)}
    return {**out, "$defs": {**out.get("$defs", {}), **defs}}


def json_grammar(schema: Any) -> str:
    """The llguidance grammar of a JSON Schema with lightinfer's whitespace policy, objects closed
    (:func:`close_objects`) and free nesting bounded (:func:`bound_free_nesting`). Numbers are bounded
    by :data:`JSON_NUMBER_GUARD_LARK`, which the backend runs beside this grammar."""
    schema = bound_free_nesting(close_objects(schema))
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
            Properties come out in the schema's order; whitespace per :data:`JSON_WHITESPACE`; an object
            that lists its ``properties`` gets no other keys unless it says ``additionalProperties``
            (:func:`close_objects`).
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
    def bounds_numbers(self) -> bool:
        """The output is JSON whose numbers :data:`JSON_NUMBER_GUARD_LARK` bounds (the "json" and
        "json_object" kinds); the backend then ANDs that grammar's mask with this one's."""
        return self.kind in ("json", "json_object")

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
