"""Constrained generation with a fake model (random logits) through matcher + bitmask: every output
parses and validates, greedy and sampled, for the 10 schemas the library was chosen on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lightinfer.structured import StructuredOutputs
from tests.structured.conftest import generate, load_cases

CASES = load_cases()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_ten_schemas_always_validate(backend, greedy) -> None:
    specs = [StructuredOutputs(json=schema) for _, schema, _, _ in CASES.SCHEMAS]
    for seed in range(2):
        # all 10 schemas in one batch, interleaved with unconstrained rows
        matchers = []
        for s in specs:
            matchers += [backend.matcher(s), None]
        results = generate(backend, matchers, greedy, seed)
        for i, (name, schema, _, _) in enumerate(CASES.SCHEMAS):
            toks, finish = results[2 * i]
            text = backend.tokenizer.decode(toks)
            assert finish == "stop", (name, finish, text)
            jsonschema.validate(json.loads(text), schema)


def test_fixed_instances_accepted_and_rejected(backend) -> None:
    for name, schema, good, bad in CASES.SCHEMAS:
        spec = StructuredOutputs(json=schema)
        for inst in good:
            m = backend.matcher(spec)
            assert m.accept_tokens(backend.tokenizer.encode(json.dumps(inst), add_special_tokens=False))
            assert m.is_accepting(), (name, inst)
        for inst in bad:
            m = backend.matcher(spec)
            ok = m.accept_tokens(backend.tokenizer.encode(json.dumps(inst), add_special_tokens=False))
            assert not (ok and m.is_accepting()), (name, inst)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_regex_choice_grammar_json_object(backend, greedy) -> None:
    cases = [(StructuredOutputs(regex=rx), lambda t, rx=rx: re.fullmatch(rx, t, re.ASCII) is not None)
             for _, rx, _, _ in CASES.REGEXES]
    cases.append((StructuredOutputs(choice=CASES.CHOICES), lambda t: t in CASES.CHOICES))
    cases.append((StructuredOutputs(grammar=CASES.LARK_GRAMMAR), _is_arithmetic))
    cases.append((StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)))
    for seed in range(3):
        results = generate(backend, [backend.matcher(s) for s, _ in cases], greedy, seed)
        for (spec, check), (toks, finish) in zip(cases, results):
            text = backend.tokenizer.decode(toks)
            assert finish == "stop" and check(text), (spec.kind, finish, text)


def _is_arithmetic(text: str) -> bool:
    if not re.fullmatch(r"[0-9+\-*/()]+", text) or re.search(r"[0-9]{4}", text):
        return False
    # balanced parentheses, operators between operands (leading zeros dropped: Python refuses "07")
    compile(re.sub(r"(?<![0-9])0+(?=[0-9])", "", text), "<expr>", "eval")
    return True


def test_never_ending_grammar_stops_at_max_tokens_with_valid_prefix(byte_backend) -> None:
    # an array of strings with no maxItems under a tiny token budget: "length", text still a valid prefix
    spec = StructuredOutputs(json={"type": "array", "items": {"type": "string"}, "minItems": 50})
    [(toks, finish)] = generate(byte_backend, [byte_backend.matcher(spec)], greedy=True, seed=0, max_tokens=20)
    assert finish == "length" and len(toks) == 20
    m = byte_backend.matcher(spec)
    assert m.accept_tokens(toks) and not m.is_accepting()
