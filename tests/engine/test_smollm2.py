"""The engine on the real embedded model (SmolLM2-135M-Instruct, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from lightinfer import LLM, SamplingParams
from tests.conftest import SMOLLM2, requires_smollm2

pytestmark = requires_smollm2

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three primary colors:",
    "Translate to German: Good morning, how are you today? I hope the weather is nice where you are.",
    "1, 2, 3, 4,",
    "Question: What is the boiling point of water at sea level in Celsius? Answer:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


# transformers' own model of the GGUF as the oracle: ~1 min on 2 cores, so among `make test-audit`'s (CI runs both)
@pytest.mark.audit
def test_greedy_matches_transformers(smollm2_llm, smollm2_hf) -> None:
    outs = smollm2_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                      eos_token_id=2, pad_token_id=2)
        expected = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == expected, prompt  # both end with EOS (id 2) or at 48 tokens
        assert out.outputs[0].finish_reason == ("stop" if expected[-1] == 2 else "length")


def test_capital_of_france(smollm2_llm) -> None:
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on max_tokens


def test_batch_invariance_and_prefix_caching(smollm2_llm) -> None:
    target = "Explain why the sky is blue in one sentence."
    others = [f"Count from {i} to {i + 20}:" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = smollm2_llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = smollm2_llm.generate(others[:8] + [target] + others[8:], params, use_tqdm=False)[8].outputs[0].token_ids
    assert alone == batched
    no_cache = LLM(SMOLLM2, dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    assert no_cache.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_prefix_cache_hit_on_shared_system_prompt(smollm2_llm) -> None:
    system = " ".join(f"Rule {i}: be concise and polite." for i in range(40))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    params = SamplingParams(temperature=0, max_tokens=4)
    a = smollm2_llm.chat(first, params, use_tqdm=False)[0]
    b = smollm2_llm.chat(second, params, use_tqdm=False)[0]
    assert len(a.prompt_token_ids) >= 200
    assert b.num_cached_tokens >= 192
    assert b.num_cached_tokens % 16 == 0


@pytest.mark.audit  # ~15 s on 2 cores: make test-audit (make test keeps preemption in the spec and structured engine tests)
def test_preemption_loses_nothing(smollm2_llm) -> None:
    prompts = [f"Story number {i}: Once upon a time" for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    # ~3 sequences of ~50 tokens fit in 10 blocks of 16
    small = LLM(SMOLLM2, dtype="float32", max_model_len=128, num_kv_blocks=10)
    got = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    engine = small.llm_engine
    assert engine.get_stats().num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_completions_share_prompt_and_seed_reproducible(smollm2_llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    a = smollm2_llm.generate(["Tell me a joke."], params, use_tqdm=False)[0]
    noise = ["Some other prompt in the batch", "And one more to change the batch"]
    b = smollm2_llm.generate(noise + ["Tell me a joke."], params, use_tqdm=False)[2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # different seeds per completion
    engine = smollm2_llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stream_pieces_join_to_final_text(smollm2_llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    prompt = smollm2_llm.llm_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello in Chinese and add a smiley emoji."}], add_generation_prompt=True,
        tokenize=False)
    pieces = list(smollm2_llm.stream(prompt, params))
    final = smollm2_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert "".join(pieces) == final
    assert all("\ufffd" not in p for p in pieces)


def test_logprobs_and_stop_strings(smollm2_llm) -> None:
    out = smollm2_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=30, logprobs=3,
                                                                 stop=[" 7"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert " 7" not in out.text and out.text.strip().startswith("5")
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) in (3, 4)
        assert max(lp.values()) == pytest.approx(lp[tok])  # greedy picks the most likely


@pytest.mark.parametrize("bad, match", [
    ("", "empty"),
    ([], "empty"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ("word " * 1100, "max_model_len"),
])
def test_bad_prompts_are_refused_before_work(smollm2_llm, bad, match) -> None:
    engine = smollm2_llm.llm_engine
    with pytest.raises(ValueError, match=match):
        smollm2_llm.generate(["fine prompt", bad], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
    ({"temperature": float("nan")}, "temperature must be a finite number"), ({"min_p": True}, "min_p must be a finite"),
    ({"stop": 5}, "stop must be a string or a list of strings"), ({"stop": ["a", 3]}, "stop must be a string"),
    ({"stop_token_ids": "a"}, "stop_token_ids must be a list"), ({"min_tokens": 1.5}, "min_tokens must be an integer"),
    ({"logprobs": "2"}, "logprobs must be an integer"),
])
def test_bad_sampling_params(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
