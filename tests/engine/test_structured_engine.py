"""Constrained decoding inside the engine, on a tiny random-weight model (its logits are noise, so only
the grammar makes the output valid): greedy and sampled, n > 1, logprobs, stop strings, preemption,
prefix caching, unconstrained neighbours untouched, grammar end -> "stop", token limit -> "length"."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from lightinfer import LLM, SamplingParams
from lightinfer.structured import StructuredOutputs
from tests.conftest import write_tiny_checkpoint
from tests.structured.conftest import load_cases

CASES = load_cases()
SCHEMAS = {name: schema for name, schema, _, _ in CASES.SCHEMAS}
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny), num_kv_blocks=256, max_model_len=512)


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schemas_validate_greedy_and_sampled(llm: LLM, temperature: float) -> None:
    names = ["nested_object", "enum", "integer_bounds", "any_of", "refs_and_const"]
    params = [SamplingParams(temperature=temperature, seed=3, max_tokens=200, structured_outputs={"json": SCHEMAS[n]})
              for n in names]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(names))], params, use_tqdm=False)
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and _valid(c.text, SCHEMAS[name]), (name, c.finish_reason, c.text)


def test_unconstrained_neighbours_are_untouched(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    steps = llm.llm_engine.structured.stats.num_steps
    llm.generate(PROMPTS[:1], free, use_tqdm=False)
    assert llm.llm_engine.structured.stats.num_steps == steps  # no constrained row: the mask is skipped
    spec = SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": SCHEMAS["enum"]})
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], [free, spec, free, spec], use_tqdm=False)
    assert [m.outputs[0].token_ids for m in (mixed[0], mixed[2])] == [a.outputs[0].token_ids for a in (alone[0],
                                                                                                      alone[2])]
    assert _valid(mixed[1].outputs[0].text, SCHEMAS["enum"]) and _valid(mixed[3].outputs[0].text, SCHEMAS["enum"])


def test_n_completions_and_logprobs_follow_the_grammar(llm: LLM) -> None:
    choices = ["alpha", "beta", "gamma"]
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, logprobs=5,
                                                  structured_outputs={"choice": choices}), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    tok = llm.tokenizer
    for c in out.outputs:
        assert c.text in choices and c.finish_reason == "stop"  # the grammar ended: no EOS step needed
        for lps in c.logprobs:
            # the masked distribution: only tokens a choice can continue with, all finite, summing to <= 1
            assert all(math.isfinite(v) for v in lps.values())
            assert sum(math.exp(v) for v in lps.values()) <= 1.0 + 1e-4
        first = tok.decode(c.token_ids[:1])
        assert all(any(ch.startswith(tok.decode([t])) for ch in choices) for t in c.logprobs[0]), first


def test_regex_and_grammar(llm: LLM) -> None:
    specs = [({"regex": r"\d{3}-\d{4}"}, lambda t: len(t) == 8 and t[3] == "-" and t.replace("-", "").isdigit()),
             ({"grammar": CASES.LARK_GRAMMAR}, lambda t: all(ch in "0123456789+-*/()" for ch in t))]
    outs = llm.generate([PROMPTS[1]] * 2, [SamplingParams(temperature=0.7, seed=5, max_tokens=120,
                                                          structured_outputs=s) for s, _ in specs], use_tqdm=False)
    for (spec, check), out in zip(specs, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (spec, c.text)


def test_token_limit_ends_with_length_and_a_valid_prefix(llm: LLM) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 40}
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, structured_outputs={"json": schema}),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    m = llm.llm_engine.structured.backend.matcher(StructuredOutputs(json=schema))
    assert m.accept_tokens(c.token_ids) and not m.is_accepting()
    assert llm.llm_engine.structured.num_active == 0  # finished sequences drop their matchers


def test_stop_string_cuts_constrained_text(llm: LLM) -> None:
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop=['"'],
                                                structured_outputs={"json": SCHEMAS["enum"]}), use_tqdm=False)[0]
    assert c.outputs[0].finish_reason == "stop" and c.outputs[0].stop_reason == '"'
    assert c.outputs[0].text.strip() == "{"  # the first key's quote ends it


def test_preemption_and_prefix_caching_keep_outputs_valid(tiny) -> None:
    # 12 blocks of 16 tokens for 6 sequences that each grow past 2 blocks: some are preempted and recomputed
    llm = LLM(str(tiny), num_kv_blocks=12, max_model_len=192)
    schema = SCHEMAS["array_of_objects"]
    prompt = list(range(60, 80))
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=120, structured_outputs={"json": schema})
    first = llm.generate([prompt], params, use_tqdm=False)  # its full prompt block is cached for the next ones
    outs = first + llm.generate([prompt] * 6, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and _valid(out.outputs[0].text, schema), out.outputs[0].text


def test_bad_constraints_are_refused_before_any_work(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs.json: is not a valid JSON Schema"):
        SamplingParams(structured_outputs={"json": {"type": "strin"}})
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}}),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_mask_filled_on_a_worker_thread_gives_the_same_tokens(llm: LLM) -> None:
    """The CUDA default: the bitmask is filled while the forward runs; the result cannot depend on it."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=120, structured_outputs={"json": SCHEMAS[name]})
              for s, name in enumerate(["enum", "pattern", "array_bounds"])]
    manager = llm.llm_engine.structured
    inline = llm.generate(PROMPTS, params, use_tqdm=False)
    manager.overlap = True
    try:
        threaded = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        manager.overlap = False
        manager.shutdown()
    assert [o.outputs[0].token_ids for o in threaded] == [o.outputs[0].token_ids for o in inline]
    assert all(o.outputs[0].finish_reason == "stop" for o in threaded)
