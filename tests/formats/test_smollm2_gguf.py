"""The embedded SmolLM2 GGUF (a real Q4_1 file: Q4_1 linears, F32 norms, a Q8_0 tied embedding) runs 4-bit
from the file: weights equal transformers' reading of it, greedy chat answers match transformers, and
the weights take a fifth of the old fp32 load."""

from __future__ import annotations

import pytest
import torch

from lightinfer import SamplingParams
from lightinfer.layers.linear import W4A16Linear
from lightinfer.layers.quant_embed import QuantizedVocabEmbedding, dequantize_rows
from lightinfer.loader import Checkpoint, load_weights
from lightinfer.models.registry import get_model_class
from tests.conftest import SMOLLM2, requires_smollm2

pytestmark = requires_smollm2

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
]
FP32_LOAD_BYTES = 538_060_032  # LLM(SMOLLM2).model_info()["weight_bytes"] before GGUF loaded 4-bit (fp32 copy)


@pytest.mark.audit  # slow against transformers' model of the GGUF: `make test-audit` (CI runs both)
def test_weights_equal_transformers_reading(smollm2_hf) -> None:  # type: ignore[no-untyped-def]
    ck = Checkpoint(SMOLLM2)
    model = get_model_class(ck.hf_config)(ck.hf_config, ck.quant_config, torch.float32)
    report = load_weights(model, ck)
    assert report["model.layers.0.self_attn.q_proj"] == "W4 (GGUF Q4_1, g32)"
    assert report["model.embed_tokens"] == "W8 (GGUF Q8_0, g32)"
    hf = dict(smollm2_hf.named_parameters())
    for i in (0, 17, 29):  # q/k rows carry llama.cpp's permutation, undone like transformers does
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
            layer = model.get_submodule(f"model.layers.{i}.{name}")
            assert isinstance(layer, W4A16Linear)
            want = hf[f"model.layers.{i}.{name}.weight"]
            torch.testing.assert_close(layer.dense_weight(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.get_submodule(f"model.layers.{i}.input_layernorm").weight,
                                   hf[f"model.layers.{i}.input_layernorm.weight"], rtol=0, atol=0)
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantizedVocabEmbedding) and model.lm_head.table is emb.table
    rows = torch.tensor([0, 1, 2, 500, 49151])
    assert torch.equal(dequantize_rows(emb.table, rows), hf["model.embed_tokens.weight"][rows])  # Q8_0: exact


@pytest.mark.audit  # slow against transformers' model of the GGUF: `make test-audit` (CI runs both)
def test_greedy_chat_matches_transformers_on_the_same_gguf(smollm2_llm, smollm2_hf) -> None:  # type: ignore[no-untyped-def]
    im_end = smollm2_llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = smollm2_llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    same = 0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                      eos_token_id=im_end, pad_token_id=im_end)
        same += out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
    assert same >= 7, f"{same}/8 chat answers identical to transformers"


def test_weights_are_a_fifth_of_the_fp32_load(smollm2_lowbit_llm) -> None:  # type: ignore[no-untyped-def]
    """As served on a CPU (dtype auto: the layers stay 4-bit, the tied table 8-bit), everything the weights
    hold counted (``weight_bytes`` includes the forms prepared for the CPU GEMM)."""
    info = smollm2_lowbit_llm.llm_engine.model_info()
    assert info["quantization"] == {"method": "gguf", "bits": 4, "group_size": 32}
    assert info["weights"]["q_proj"] == "W4 (GGUF Q4_1, g32)"
    assert info["weight_bytes"] <= 0.35 * FP32_LOAD_BYTES


def test_lowbit_cpu_path_answers_as_the_exact_path(smollm2_lowbit_llm, smollm2_llm) -> None:  # type: ignore[no-untyped-def]
    """As served on a CPU (bf16 activations between layers, 4-/8-bit weights) against the exact fp32 path on the
    same file: the same greedy answers but where the two were at a near-tie (each side's token among the other's
    top 3 where they part; measured with torch's int4 GEMM: 6 of 8 answers identical over 32 tokens on an
    AVX-512 CPU, 4 of 8 on an AVX2 one, whose int4 kernel sums in another order, and 2 of 8 there with the C ops
    of kernels/cpu_native.py, every fork a near-tie; on an AVX-512 Xeon 2026-12-06 with the C 4-bit product 2-3
    of 8, torch's int4 GEMM 2, int8 activations 1-2). The quality measures are the logits of a short prompt and
    the held-out perplexity (next tests, docs/cpu_performance.md)."""
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    fast = [o.outputs[0] for o in smollm2_lowbit_llm.chat(chats, params, use_tqdm=False)]
    exact = [o.outputs[0] for o in smollm2_llm.chat(chats, params, use_tqdm=False)]
    identical = 0
    for a, b in zip(fast, exact):
        identical += a.token_ids == b.token_ids
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[step] and tb in a.logprobs[step], (step, a.logprobs[step], b.logprobs[step])
                break
    assert identical >= 2, f"{identical}/8 answers identical"


def test_lowbit_cpu_path_logits_of_a_short_prompt(smollm2_lowbit_llm, smollm2_llm, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A prompt shorter than a prefill's dense path (``cpu_native.dense_rows``, raised here where the CPU's bf16
    or AMX dense path would start below it), so every 4-bit product runs the decode step's kernel: logits within 5% of
    the exact path's norm (measured 3.1% with the C product, 3.0% with torch's int4 GEMM, 10% with int8
    activations; 2026-12-06, AVX-512 Xeon), the greedy choice the same at nine positions of ten."""
    from lightinfer.kernels import cpu_native

    prompt = smollm2_lowbit_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    monkeypatch.setattr(cpu_native, "W4_DENSE_ROWS_BF16", cpu_native.W4_DENSE_ROWS)
    monkeypatch.setattr(cpu_native, "W4_AMX_ROWS", cpu_native.W4_DENSE_ROWS)
    assert len(prompt) < cpu_native.dense_rows(torch.bfloat16)
    fast = smollm2_lowbit_llm.llm_engine.prompt_logits(prompt).float()
    exact = smollm2_llm.llm_engine.prompt_logits(prompt).float()
    assert float((fast - exact).norm() / exact.norm()) < 0.05
    assert float((fast.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9


def test_lowbit_cpu_path_answers_the_readme_question_with_fp32_logits(smollm2_lowbit_llm) -> None:  # type: ignore[no-untyped-def]
    """The default CPU path's LM head returns fp32 logits: rounded to bf16 (steps of 0.125 at SmolLM2's logit
    sizes) 'The' and 'L' tied as the first token of this answer on an AMX CPU and the greedy pick (lowest id)
    wrote "L'Étoile, la Marseillaise, ..." instead of Paris."""
    prompt = smollm2_lowbit_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    logits = smollm2_lowbit_llm.llm_engine.prompt_logits(prompt).float()
    assert bool((logits != logits.bfloat16().float()).any())
    out = smollm2_lowbit_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                                  SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.audit  # two engines' perplexity over held-out text: `make test-audit` (CI runs both)
def test_lowbit_cpu_path_perplexity_is_the_exact_paths(smollm2_lowbit_llm, smollm2_llm) -> None:  # type: ignore[no-untyped-def]
    """Held-out perplexity of the default CPU path (4-/8-bit weights, bf16 activations between layers) against
    the exact fp32 path on the same weights, 2,048 tokens in 1,024-token windows (a prefill: the 4-bit layers take
    the dense path of cpu_native.w4_linear): measured +0.34% with torch's int4 GEMM (2026-12-06, AVX-512 Xeon),
    +0.41% with the C product over 4,096 tokens (bench/kernels/cpu_w4.py). A wrong scale, offset or layout costs tens of
    percent."""
    from lightinfer.evaluate import perplexity

    fast = perplexity(llm=smollm2_lowbit_llm, max_tokens=2048, window=1024).ppl
    exact = perplexity(llm=smollm2_llm, max_tokens=2048, window=1024).ppl
    assert fast / exact - 1 < 0.01, (fast, exact)
