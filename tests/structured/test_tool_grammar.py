"""Tool-call grammars: "required" / named / "auto", parallel or not, in each call format."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lightinfer.structured import build_tool_call_grammar, parse_tool_calls
from tests.structured.conftest import generate

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {  # local $refs must survive embedding
    "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "type": "object",
    "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
NAMED = {"type": "function", "function": {"name": "add"}}

ONE = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
       "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
       "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'}
TWO = {"hermes": ONE["hermes"] + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                                 '"unit": "C"}}\n</tool_call>',
       "llama3_json": ONE["llama3_json"] + '; {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}',
       "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                  '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]'}
BAD = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 100, "b": 2}}\n</tool_call>',
       "llama3_json": '{"name": "add", "parameters": {"a": 1}}',
       "mistral": '[TOOL_CALLS] [{"name": "sub", "arguments": {"a": 1, "b": 2}}]'}
FORMATS = list(ONE)


def accepts(backend, spec, text: str) -> bool:
    m = backend.matcher(spec)
    return m.accept_tokens(backend.tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["required", "auto", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_what_each_choice_allows(byte_backend, fmt, choice, parallel) -> None:
    spec = build_tool_call_grammar(TOOLS, NAMED if choice == "named" else choice, fmt, parallel)
    assert accepts(byte_backend, spec, ONE[fmt])
    assert accepts(byte_backend, spec, TWO[fmt]) == (parallel and choice != "named")
    assert not accepts(byte_backend, spec, BAD[fmt])
    assert accepts(byte_backend, spec, "It is sunny.") == (choice == "auto")
    if choice == "named":  # only the named function
        assert not accepts(byte_backend, spec, ONE[fmt].replace('"add", ', '"get_weather", ')
                           .replace('{"a": 1, "b": 2}', '{"city": "Oslo", "unit": "C"}'))
    if choice == "auto" and fmt != "llama3_json":  # text, then a call
        assert accepts(byte_backend, spec, "Let me look.\n" + ONE[fmt])


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_call_that_starts_is_completed_validly(byte_backend, fmt) -> None:
    spec = build_tool_call_grammar(TOOLS, "auto", fmt)
    m = byte_backend.matcher(spec)
    opener = "Sure. " + ("<tool_call>\n" if fmt == "hermes" else "[TOOL_CALLS] [")
    assert m.accept_tokens(byte_backend.tokenizer.encode(opener, add_special_tokens=False))
    allowed = {byte_backend.tokenizer.decode([t]) for t in m.allowed_token_ids()}
    assert allowed and all(a.startswith("{") or not a.strip() for a in allowed), allowed
    assert not m.accept_tokens(byte_backend.tokenizer.encode("Never mind.", add_special_tokens=False))


def test_markers_that_are_special_tokens_are_matched_as_tokens(special_backend) -> None:
    be, tok = special_backend, special_backend.tokenizer
    for fmt, marker in (("mistral", "[TOOL_CALLS]"), ("hermes", "<tool_call>")):
        spec = build_tool_call_grammar(TOOLS, "required", fmt, special_tokens=be.special_token_id)
        ids = tok.encode(ONE[fmt], add_special_tokens=False)
        assert be.special_token_id(marker) in ids  # the tokenizer produced the token ...
        m = be.matcher(spec)
        assert m.accept_tokens(ids) and m.is_accepting()  # ... and the grammar takes it
        spelled = tok.encode(marker[:-1], add_special_tokens=False) + tok.encode(marker[-1], add_special_tokens=False)
        assert be.special_token_id(marker) not in spelled and not be.matcher(spec).accept_tokens(spelled)
    spec = build_tool_call_grammar(TOOLS, "required", "llama3_json", special_tokens={"<|python_tag|>": be.special_token_id("<|python_tag|>")})
    assert accepts(be, spec, "<|python_tag|>" + ONE["llama3_json"]) and accepts(be, spec, ONE["llama3_json"])
    auto = build_tool_call_grammar(TOOLS, "auto", "mistral", special_tokens=be.special_token_id)
    assert accepts(be, auto, "Checking.") and accepts(be, auto, "Checking. " + ONE["mistral"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_generated_calls_parse_and_validate(backend, fmt, choice) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    spec = build_tool_call_grammar(TOOLS, NAMED if choice == "named" else choice, fmt, parallel_tool_calls=True)
    for greedy in (True, False):
        results = generate(backend, [backend.matcher(spec) for _ in range(3)], greedy, seed=7)
        for toks, finish in results:
            assert finish == "stop"
            parsed = parse_tool_calls(backend.tokenizer.decode(toks), fmt)
            if choice != "auto":
                assert parsed.tool_calls and parsed.content is None
            if choice == "named":
                assert [c.name for c in parsed.tool_calls] == ["add"]
            for call in parsed.tool_calls:
                jsonschema.validate(json.loads(call.arguments), params[call.name])


def test_none_and_errors() -> None:
    assert build_tool_call_grammar(TOOLS, "none", "hermes") is None
    assert build_tool_call_grammar([], None, "hermes") is None
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters: .*uniqueItems"):
        build_tool_call_grammar([WEATHER, {"type": "function", "function": {"name": "tags", "parameters": {
            "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}], "auto", "hermes")
    with pytest.raises(ValueError, match="tool_choice.function.name: 'nope' is not in tools"):
        build_tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes")
    with pytest.raises(ValueError, match=r"tools\[0\]\.type"):
        build_tool_call_grammar([{"type": "code_interpreter"}], "auto", "hermes")
    with pytest.raises(ValueError, match="tool-call parser 'xml' is unknown"):
        build_tool_call_grammar(TOOLS, "auto", "xml")


THINK = "<think>\nThe user wants a sum.\n</think>\n\n"


@pytest.mark.parametrize("backend_name", ["byte_backend", "special_think_backend"])
def test_reasoning_block_before_the_answer(request, backend_name: str) -> None:
    """Qwen3-style templates think first: the forced call may follow a <think> block ("optional"), or must
    close one the prompt opened ("open"); "auto" takes the block too. Markers work as text or as tokens."""
    backend = request.getfixturevalue(backend_name)
    special = backend.special_token_id
    call = ONE["hermes"]
    optional = build_tool_call_grammar(TOOLS, "required", "hermes", special_tokens=special, reasoning="optional")
    assert accepts(backend, optional, THINK + call) and accepts(backend, optional, call)
    assert not accepts(backend, optional, "<think>\nhm </think> more\n</think>\n\n" + call)  # ends at the first
    assert not accepts(backend, optional, THINK + "Sure! " + call)  # after thinking: the call, nothing else
    opened = build_tool_call_grammar(TOOLS, NAMED, "hermes", special_tokens=special, reasoning="open")
    assert accepts(backend, opened, THINK[len("<think>"):] + call) and not accepts(backend, opened, call)
    auto = build_tool_call_grammar(TOOLS, "auto", "hermes", special_tokens=special, reasoning="optional")
    assert accepts(backend, auto, THINK + "It is 3.") and accepts(backend, auto, THINK + call)
    with pytest.raises(ValueError, match="reasoning must be one of"):
        build_tool_call_grammar(TOOLS, "required", "hermes", reasoning="always")


@pytest.fixture(scope="module")
def special_think_backend():
    from lightinfer.structured import GrammarBackend
    from tests.structured.conftest import SPECIAL, byte_tokenizer

    return GrammarBackend(byte_tokenizer([*SPECIAL, "<think>", "</think>"]))


def test_free_arguments_nest_at_most_the_free_depth(byte_backend) -> None:
    """A tool whose parameters say only "object" cannot nest its arguments without end."""
    from lightinfer.structured.spec import JSON_MAX_FREE_NESTING as depth

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    spec = build_tool_call_grammar(tools, "required", "hermes", parallel_tool_calls=False)

    def fits(args: str) -> bool:
        m = byte_backend.matcher(spec)
        text = '<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"
        return m.accept_tokens(byte_backend.tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    def nested(levels: int) -> str:
        return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)

    assert fits('{"city": "Paris"}') and fits(nested(depth)) and not fits(nested(depth + 1))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("reasoning", [None, "optional"])
def test_auto_with_a_json_answer_format_takes_that_json_or_calls(byte_backend, fmt, reasoning) -> None:
    """Tools with tool_choice "auto" and a JSON response format (Codex CLI's --output-schema): the reply is JSON of
    that schema or the calls; free text, or JSON of another shape, is not."""
    from lightinfer.structured import StructuredOutputs
    from lightinfer.structured.tool_grammar import with_answer_format

    answer = StructuredOutputs(json={"type": "object", "properties": {"summary": {"type": "string"}},
                                     "required": ["summary"]})
    spec = with_answer_format(build_tool_call_grammar(TOOLS, "auto", fmt, reasoning=reasoning), answer)
    assert accepts(byte_backend, spec, '{"summary": "done"}')
    assert accepts(byte_backend, spec, ONE[fmt]) and accepts(byte_backend, spec, TWO[fmt])
    assert not accepts(byte_backend, spec, "It is sunny.")
    assert not accepts(byte_backend, spec, '{"result": 1}')
    if reasoning:
        assert accepts(byte_backend, spec, '<think>easy</think>\n{"summary": "done"}')
    with pytest.raises(ValueError, match="regex constraint cannot be combined"):
        with_answer_format(spec, StructuredOutputs(regex="a+"))
