"""StructuredOutputs: normalization, cache keys, and every bad input as a ValueError naming the field."""

from __future__ import annotations

import json

import pytest

from lightinfer.structured import StructuredOutputs, StructuredOutputsError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_json_forms_are_one_constraint() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    a = StructuredOutputs(json=SCHEMA)
    b = StructuredOutputs(json=json.dumps(SCHEMA))
    assert a.json == SCHEMA and b.json == SCHEMA and a == b and hash(a) == hash(b) and a.kind == "json"
    p = StructuredOutputs(json=Point)
    assert p.json["required"] == ["x", "y"] and p != a
    assert StructuredOutputs(json_object=True).kind == "json_object"
    c = StructuredOutputs(choice=["x", "y"])
    assert c.choice == ("x", "y") and c.kind == "choice" and c != StructuredOutputs(choice=["y", "x"])
    assert StructuredOutputs(regex=r"\d+").key != StructuredOutputs(grammar='start: "1"').key


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    ({}, "json", "exactly one"),
    ({"json": SCHEMA, "regex": "a"}, "json/regex", "exactly one"),
    ({"json": "{not json"}, "json", "not JSON"),
    ({"json": 5}, "json", "JSON Schema object"),
    ({"json": {"type": "strin"}}, "json", "not a valid JSON Schema"),
    ({"json": {"type": "object", "properties": {"a": {"minimum": "zero"}}}}, "json", "not a valid JSON Schema"),
    ({"json": {"type": "array", "uniqueItems": True}}, "json", "uniqueItems"),
    ({"json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, "json", "if, then"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "json", "no-such-format"),
    ({"json_object": "yes"}, "json_object", "true or false"),
    ({"regex": "["}, "regex", "unclosed character class"),
    ({"regex": "a(?=b)"}, "regex", "look-around"),
    ({"regex": ""}, "regex", "non-empty"),
    ({"choice": []}, "choice", "non-empty list"),
    ({"choice": "yes"}, "choice", "non-empty list"),
    ({"choice": ["a", 3]}, "choice", "only strings"),
    ({"grammar": "start: undefined_rule"}, "grammar", "unknown name"),
    ({"grammar": "  "}, "grammar", "non-empty"),
    ({"grammar": "root ::= (("}, "grammar", ""),
])
def test_bad_input_names_the_field(kwargs, field, words) -> None:
    with pytest.raises(StructuredOutputsError) as e:
        StructuredOutputs(**kwargs)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field and str(e.value).startswith(f"structured_outputs.{field}: ")
    assert words in str(e.value)
    assert "<grammar>" not in str(e.value) and len(str(e.value)) < 400  # the cause, not a dump


def test_gbnf_and_lark_grammars_are_read() -> None:
    gbnf = StructuredOutputs(grammar='root ::= "yes" | "no"')
    lark = StructuredOutputs(grammar='start: "yes" | "no"')
    assert gbnf.kind == lark.kind == "grammar" and gbnf.llguidance_grammar and lark.llguidance_grammar


def test_enforced_keywords_compile() -> None:
    for schema in ({"type": "string", "format": "date-time"}, {"type": "integer", "multipleOf": 3},
                   {"type": "object", "minProperties": 1}, {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                   {"type": "array", "prefixItems": [{"type": "integer"}], "maxItems": 2}):
        assert StructuredOutputs(json=schema).json == schema
