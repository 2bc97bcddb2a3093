"""The cases the grammar library was chosen on, shared by bench/structured/ and tests/structured/ (the library
comparison that used them, bench/structured_libs.py, is at commit e1f3011; docs/performance.md sums it up).

Each JSON case is ``(name, schema, valid instances, invalid instances)``: the valid ones must be
accepted by a matcher (as ``json.dumps`` text), the invalid ones rejected. ``KEYWORD_PROBES`` hold one
JSON-Schema keyword each with an instance that satisfies the whole schema and one that breaks only
that keyword: a library that accepts the breaking one ignores the keyword silently.
"""

from __future__ import annotations

from typing import Any

JsonCase = tuple[str, dict[str, Any], list[Any], list[Any]]

SCHEMAS: list[JsonCase] = [
    ("nested_object", {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                            "required": ["city", "zip"], "additionalProperties": False}},
                "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
        [{"user": {"name": "Ann", "address": {"city": "Oslo", "zip": "01234"}}}],
        [{"user": {"name": "Ann"}}, {"user": {"name": "Ann", "address": {"city": "Oslo", "zip": "12"}}}]),
    ("array_bounds", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
        [{"tags": ["a", "b"]}, {"tags": ["a", "b", "c", "d"]}],
        [{"tags": ["a"]}, {"tags": ["a", "b", "c", "d", "e"]}]),
    ("enum", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"], "additionalProperties": False},
        [{"color": "red", "size": 3}],
        [{"color": "pink", "size": 1}, {"color": "red", "size": 4}]),
    ("pattern", {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
        "required": ["phone", "code"], "additionalProperties": False},
        [{"phone": "555-1234", "code": "AB12"}],
        [{"phone": "5551234", "code": "AB12"}, {"phone": "555-1234", "code": "ab12"}]),
    ("integer_bounds", {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "score": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["age", "score"], "additionalProperties": False},
        [{"age": 0, "score": -5}, {"age": 120, "score": 5}],
        [{"age": 121, "score": 0}, {"age": -1, "score": 0}, {"age": 3.5, "score": 0}]),
    ("required_optional", {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "note": {"type": "string", "maxLength": 15},
                       "done": {"type": "boolean"}},
        "required": ["id"], "additionalProperties": False},
        [{"id": 1}, {"id": 2, "note": "x", "done": True}, {"id": 3, "done": False}],
        [{"note": "x"}, {"id": 1, "extra": 2}]),
    ("any_of", {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "enum": ["none", "all"]}]}},
        "required": ["value"], "additionalProperties": False},
        [{"value": 7}, {"value": "all"}],
        [{"value": 10}, {"value": "some"}, {"value": True}]),
    ("array_of_objects", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
        [{"items": [{"sku": "ABC", "qty": 2}]}],
        [{"items": []}, {"items": [{"sku": "ABC", "qty": 0}]}]),
    ("numbers_and_bools", {
        "type": "object",
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ratio", "ok", "nothing"], "additionalProperties": False},
        [{"ratio": 0.5, "ok": False, "nothing": None}],
        [{"ratio": 1.5, "ok": False, "nothing": None}, {"ratio": 0.5, "ok": "no", "nothing": None}]),
    ("refs_and_const", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"kind": {"const": "segment"}, "start": {"$ref": "#/$defs/point"},
                       "end": {"$ref": "#/$defs/point"}},
        "required": ["kind", "start", "end"], "additionalProperties": False},
        [{"kind": "segment", "start": {"x": 0, "y": 1}, "end": {"x": 9, "y": 9}}],
        [{"kind": "line", "start": {"x": 0, "y": 1}, "end": {"x": 9, "y": 9}},
         {"kind": "segment", "start": {"x": 0}, "end": {"x": 9, "y": 9}}]),
]


def twenty_property_schema() -> dict[str, Any]:
    """A 20-property object mixing the common types (the compile-time case)."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "number"}, {"type": "boolean"}, {"enum": ["low", "medium", "high"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 5},
             {"type": "string", "pattern": "^[a-z]+-[0-9]{2,4}$"},
             {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a"], "additionalProperties": False}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)[:12], "additionalProperties": False}


# (name, regex, matching strings, non-matching strings)
REGEXES: list[tuple[str, str, list[str], list[str]]] = [
    ("phone", r"\d{3}-\d{4}", ["555-1234"], ["5551234", "555-12345"]),
    ("email", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)", ["ann@mail.com"], ["ann@mail", "Ann@mail.com"]),
    ("date", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", ["2024-02-29"], ["2024-13-01"]),
]
CHOICES: list[str] = ["positive", "negative", "neutral"]
# A Lark grammar (both libraries read Lark): integer arithmetic with parentheses, bounded numbers.
LARK_GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
GRAMMAR_VALID = ["1+2*3", "(4-5)/6", "((7))"]
GRAMMAR_INVALID = ["1+", "(1", "1++2", "1234"]

# (keyword, schema, instance that satisfies the schema, instance that breaks only this keyword)
KEYWORD_PROBES: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, 6, 5),
    ("const", {"const": "x"}, "x", "y"),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    ("additionalProperties:false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    ("oneOf (overlapping)", {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, -1, 1),
    ("minProperties", {"type": "object", "minProperties": 1}, {"a": 1}, {}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}},
     {"n_a": 1}, {"n_a": "x"}),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 9, 10),
    ("format:date-time", {"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    ("format:email", {"type": "string", "format": "email"}, "a@b.com", "not an email"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [1, 2], [2, 3]),
    ("not", {"type": "integer", "not": {"const": 3}}, 2, 3),
    ("if/then/else", {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, 12, 11),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"A1": 1}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("minContains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2},
     [1, 1], [1, 2]),
]
