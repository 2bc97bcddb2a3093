"""Speculative decoding in the engine, on tiny random-weight models: greedy output is the same token for token
with speculation on and off, across the engine's features (continuous batching of several requests, chunked
prefill, preemption, prefix caching, INT8 KV, sliding windows and KV-cache groups, MoE, penalties, logprobs, stop
strings and max_tokens inside an accepted run, structured outputs beside drafting requests), and every test
checks that drafts were really verified (a run without any would make it vacuous)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightinfer import LLM, SamplingParams
from tests.conftest import write_tiny_checkpoint
from tests.engine.spec.policies import AlwaysDraft

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# prompts that repeat themselves, so that prompt lookup finds matches
PROMPTS = [[5, 6, 7, 8] * 6, [40, 41, 42, 40, 41, 43] * 4 + [40], list(range(60, 90)) + list(range(60, 70)),
           [9, 10] * 12 + [11]]


def _pair(path: Path, **options: object) -> tuple[LLM, LLM]:
    common = {"dtype": "float32", "show_progress": False, **options}
    on = LLM(str(path), speculative_config=SPEC, **common)
    on.llm_engine.speculator.policy = AlwaysDraft(SPEC["num_speculative_tokens"])
    return LLM(str(path), **common), on


def _same(off: LLM, on: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list:
    a = off.generate(prompts, params, use_tqdm=False)
    b = on.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cy.token_ids == cx.token_ids
            assert (cy.text, cy.finish_reason, cy.stop_reason) == (cx.text, cx.finish_reason, cx.stop_reason)
    info = on.llm_engine.speculator.info()
    assert info["num_drafts"] > 0 and info["num_accepted_tokens"] > 0, info
    return b


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM", seed=3)


def test_greedy_is_identical_in_a_batch_with_logprobs_and_penalties(llama: Path) -> None:
    off, on = _pair(llama, num_kv_blocks=64, max_num_batched_tokens=32)  # 32: prompts are chunked
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    out = _same(off, on, PROMPTS, greedy)
    ref = off.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].logprobs
    for a, b in zip(ref, out[0].outputs[0].logprobs):  # the target's logprobs, whichever row they came from
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    _same(off, on, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                                           frequency_penalty=0.2))


def test_stop_strings_tokens_and_max_tokens_inside_an_accepted_run(llama: Path) -> None:
    off, on = _pair(llama, num_kv_blocks=64)
    free = off.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[10:13] or "zz" for o in free]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s]) for s in stops]
    for o in _same(off, on, PROMPTS, params):
        assert o.outputs[0].finish_reason == "stop"
    stop_ids = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=[o.outputs[0].token_ids[9]]) for o in free]
    _same(off, on, PROMPTS, stop_ids)
    for o in _same(off, on, PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)):
        assert len(o.outputs[0].token_ids) == 7


def test_preemption_and_prefix_caching(llama: Path) -> None:
    # 10 blocks of 16 tokens for 4 sequences of up to ~80 tokens: sequences are preempted and recomputed
    off, on = _pair(llama, num_kv_blocks=10, block_size=16, max_model_len=128)
    _same(off, on, PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert on.llm_engine.scheduler.num_preemptions > 0
    assert on.llm_engine.block_manager.num_free_blocks == 10  # nothing leaked
    cached = on.generate(PROMPTS[:1] * 2, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)
    assert cached[0].outputs[0].token_ids == cached[1].outputs[0].token_ids


def test_int8_kv_cache(llama: Path) -> None:
    off, on = _pair(llama, num_kv_blocks=64, kv_cache_dtype="int8")
    _same(off, on, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


@pytest.mark.parametrize("arch, overrides", [
    ("MistralForCausalLM", {"sliding_window": 24}),
    ("Gemma2ForCausalLM", {"sliding_window": 24, "head_dim": 16}),  # two KV-cache groups
    ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_windows_kv_groups_and_moe(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = write_tiny_checkpoint(tmp_path / arch, arch, seed=3, **overrides)
    off, on = _pair(path, num_kv_blocks=64)
    _same(off, on, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def test_seeded_sampling_is_identical_and_n_forks(llama: Path) -> None:
    """A request with a seed draws one number per emitted token from its own generator, with speculation on as
    off: the same tokens (verify.py); ``n = 2`` forks after the prompt and both completions draft."""
    off, on = _pair(llama, num_kv_blocks=64)
    params = SamplingParams(temperature=0.05, top_p=0.9, max_tokens=30, ignore_eos=True, n=2, seed=7)
    out = _same(off, on, PROMPTS, params)
    assert all(len(c.token_ids) == 30 for o in out for c in o.outputs)
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in out)


def test_a_grammar_request_beside_drafting_ones(llama: Path) -> None:
    from lightinfer.structured.spec import StructuredOutputs

    off, on = _pair(llama, num_kv_blocks=64)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[ab]{5,20}"))]
    out = _same(off, on, PROMPTS, params)
    assert set(out[3].outputs[0].text) <= {"a", "b"} and len(out[3].outputs[0].text) >= 5


def test_bad_config_is_one_clear_error(llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown key"):
        LLM(str(llama), speculative_config={"method": "ngram", "num_tokens": 3}, show_progress=False)


def test_suffix_drafts_from_earlier_requests(llama: Path) -> None:
    """method "suffix": greedy output identical; the second request of a repeated prompt drafts from the first
    one's output (shared counts), so nearly every draft is accepted."""
    common = {"dtype": "float32", "show_progress": False, "num_kv_blocks": 64}
    off = LLM(str(llama), **common)
    on = LLM(str(llama), speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                             "suffix_decoding_min_token_prob": 0.1}, **common)
    on.llm_engine.speculator.policy = AlwaysDraft(4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [list(range(100, 130))]  # repeats nothing itself
    first = on.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    before = on.llm_engine.speculator.info()
    again = on.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    after = on.llm_engine.speculator.info()
    assert first == again == off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafted >= 30 and accepted >= 0.9 * drafted, after
