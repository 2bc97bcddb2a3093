"""GrammarMatcher and GrammarBackend: accept/refuse, termination, EOS, rollback, replay, fork, cache."""

from __future__ import annotations

import pytest

from lightinfer.structured import GrammarBackend, StructuredOutputs, StructuredOutputsError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"], "additionalProperties": False}


def ids(backend: GrammarBackend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


def test_accept_refuse_and_terminate(backend) -> None:
    m = backend.matcher(StructuredOutputs(json=SCHEMA))
    text = '{"a": 12, "b": "x"}'
    toks = ids(backend, text)
    assert not m.accept_token(ids(backend, "[")[0])  # refused ...
    assert m.num_accepted == 0 and m.error is None  # ... and the state is untouched
    assert not m.accept_tokens(ids(backend, '{"c": 1}'))  # all or nothing
    assert m.num_accepted == 0
    for t in toks[:-1]:
        assert m.accept_token(t) and not m.is_terminated()
    assert m.accept_token(toks[-1]) and m.is_terminated() and m.is_accepting()
    assert m.allowed_token_ids() == list(backend.eos_token_ids)  # only EOS after the closing brace


def test_eos_allowed_exactly_where_the_grammar_may_end(backend) -> None:
    m = backend.matcher(StructuredOutputs(regex=r"[0-9]{1,4}"))
    eos = backend.eos_token_ids[0]
    assert eos not in m.allowed_token_ids() and not m.accept_token(eos)
    assert m.accept_tokens(ids(backend, "12")) and m.is_accepting() and not m.is_terminated()
    assert eos in m.allowed_token_ids()
    assert m.accept_token(eos) and m.is_terminated()


def test_choice_terminates(backend) -> None:
    m = backend.matcher(StructuredOutputs(choice=["positive", "negative"]))
    assert m.accept_tokens(ids(backend, "negative")) and m.is_terminated()


def test_rollback_and_replay_restore_the_state(backend) -> None:
    spec = StructuredOutputs(json=SCHEMA)
    toks = ids(backend, '{"a": 12, "b": "xy"}')
    m = backend.matcher(spec)
    assert m.accept_tokens(toks[:4])
    at_four = m.allowed_token_ids()
    assert m.accept_tokens(toks[4:])
    m.rollback(len(toks) - 4)
    assert m.num_accepted == 4 and m.allowed_token_ids() == at_four and not m.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back 5 tokens: 4 were accepted"):
        m.rollback(5)
    # preemption by recompute: a fresh matcher replays the generated tokens
    fresh = backend.matcher(spec)
    assert fresh.replay(toks[:4]) and fresh.allowed_token_ids() == at_four and fresh.num_accepted == 4
    assert not fresh.replay(ids(backend, "nope")) and fresh.num_accepted == 0
    m.reset()
    assert m.num_accepted == 0 and m.allowed_token_ids() == backend.matcher(spec).allowed_token_ids()


def test_fork_is_independent(backend) -> None:
    m = backend.matcher(StructuredOutputs(json=SCHEMA))
    assert m.accept_tokens(ids(backend, '{"a": 1'))
    twin = m.fork()
    assert twin.num_accepted == m.num_accepted and twin.allowed_token_ids() == m.allowed_token_ids()
    assert twin.accept_tokens(ids(backend, ', "b": "q"}')) and twin.is_terminated()
    assert not m.is_terminated() and m.accept_tokens(ids(backend, '2, "b": "r"}')) and m.is_terminated()


def test_compile_cache(byte_tokenizer_backend_factory) -> None:
    be = byte_tokenizer_backend_factory(cache_size=2)
    spec = StructuredOutputs(json=SCHEMA)
    a, b = be.matcher(spec), be.matcher(StructuredOutputs(json=dict(SCHEMA)))
    assert be.cache_info() == {"size": 1, "capacity": 2}
    assert a.accept_tokens(ids(be, '{"a": 1')) and b.num_accepted == 0  # copies, not shared state
    be.matcher(StructuredOutputs(regex="a"))
    be.matcher(StructuredOutputs(regex="b"))
    assert be.cache_info()["size"] == 2  # least recently used dropped


@pytest.fixture
def byte_tokenizer_backend_factory():
    from tests.structured.conftest import byte_tokenizer

    return lambda **kw: GrammarBackend(byte_tokenizer(), **kw)


def test_backend_errors(byte_tokenizer_backend_factory) -> None:
    from transformers import PreTrainedTokenizer

    class Slow(PreTrainedTokenizer):
        pass

    with pytest.raises(ValueError, match="fast"):
        GrammarBackend(object.__new__(Slow))
    from tests.structured.conftest import byte_tokenizer

    tok = byte_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarBackend(tok)
    be = GrammarBackend(tok, eos_token_ids=[3, 5, 3])
    assert be.eos_token_ids == (3, 5) and be.bitmask_width == (be.vocab_size + 31) // 32
    # a grammar that needs a special token this tokenizer lacks: refused at compile, naming the field
    with pytest.raises(StructuredOutputsError, match="structured_outputs.grammar: .*tokenizer"):
        be.matcher(StructuredOutputs(grammar='start: "a" <[999999]>'))


def test_special_token_lookup(special_backend, byte_backend) -> None:
    tid = special_backend.special_token_id("[TOOL_CALLS]")
    assert tid is not None and special_backend.tokenizer.convert_ids_to_tokens(tid) == "[TOOL_CALLS]"
    assert byte_backend.special_token_id("[TOOL_CALLS]") is None
    assert special_backend.special_token_id("a") is None  # an ordinary token


def test_json_whitespace_is_bounded(byte_backend) -> None:
    """Compact, one-space and pretty-printed JSON pass; runs of blanks (a small model's loop) do not."""
    spec = StructuredOutputs(json=SCHEMA)

    def ok(text: str) -> bool:
        m = byte_backend.matcher(spec)
        return m.accept_tokens(ids(byte_backend, text)) and m.is_accepting()

    assert ok('{"a":1,"b":"x"}') and ok('{"a": 1, "b": "x"}') and ok('{\n  "a": 1,\n  "b": "x"\n}')
    assert not ok('{"a":     1, "b": "x"}') and not ok('{"a": 1,\n\n\n"b": "x"}')


def _fits(backend: GrammarBackend, spec: StructuredOutputs, text: str) -> bool:
    m = backend.matcher(spec)
    return m.accept_tokens(ids(backend, text)) and m.is_accepting()


def test_json_numbers_are_bounded_to_float64(byte_backend) -> None:
    """17 significant digits, 3 exponent digits, 19-digit integers pass; one more digit anywhere does not
    (a small model looping inside "31.2389888..." is made to stop the number)."""
    number = StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "number"}}})
    integer = StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    free = StructuredOutputs(json_object=True)
    for spec in (number, free):
        for good in ("0", "-1.5", "31.238988888888888", "0.00000000000000001", "1.7976931348623157e308",
                     "4.9E-324", "12345678901234567", "1e+005", "-1.2345678901234567e10"):
            assert _fits(byte_backend, spec, f'{{"x": {good}}}'), (spec.kind, good)
        for bad in ("31.2389888888888888", "0.000000000000000001", "1e1000", "12345678901234567.5",
                    "1" * 20, "-1.23456789012345678e10"):
            assert not _fits(byte_backend, spec, f'{{"x": {bad}}}'), (spec.kind, bad)
    assert _fits(byte_backend, integer, '{"x": -9223372036854775808}')
    assert not _fits(byte_backend, integer, '{"x": 12345678901234567890}')
    # the bound is on what is generated: every step's mask agrees with accept_token
    m = byte_backend.matcher(number)
    assert m.accept_tokens(ids(byte_backend, '{"x": 1.' + "2" * 16))
    digit = ids(byte_backend, "3")[0]
    assert digit not in m.allowed_token_ids() and not m.accept_token(digit)
    assert ids(byte_backend, "}")[0] in m.allowed_token_ids()
    twin = m.fork()  # the bound travels with forks, rollbacks and resets
    assert not twin.accept_token(digit)
    m.rollback(1)
    assert m.accept_token(digit)
    m.reset()
    assert m.accept_tokens(ids(byte_backend, '{"x": 7}')) and m.is_accepting()


def test_free_nesting_is_bounded_where_the_schema_is_silent(byte_backend) -> None:
    from lightinfer.structured.spec import JSON_MAX_FREE_NESTING as depth

    def nested(levels: int, inner: str = "1") -> str:
        return '{"a": ' * levels + inner + "}" * levels

    free = StructuredOutputs(json_object=True)
    assert _fits(byte_backend, free, nested(depth)) and not _fits(byte_backend, free, nested(depth + 1))
    assert _fits(byte_backend, free, '{"a": [[{"b": [1, "x", null, true]}]], "c": {}}')
    # a free property ({} / true) gets the bound below it; arrays without items too
    schema = {"type": "object", "properties": {"meta": {}, "list": {"type": "array"}}, "required": ["meta", "list"]}
    spec = StructuredOutputs(json=schema)
    assert _fits(byte_backend, spec, '{"meta": ' + nested(depth) + ', "list": []}')
    assert not _fits(byte_backend, spec, '{"meta": ' + nested(depth + 1) + ', "list": []}')
    assert not _fits(byte_backend, spec, '{"meta": 1, "list": ' + "[" * (depth + 1) + "]" * (depth + 1) + "}")
    # nesting the schema spells out is not limited
    deep: dict = {"type": "integer"}
    for _ in range(depth + 4):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert _fits(byte_backend, StructuredOutputs(json=deep), nested(depth + 4))
