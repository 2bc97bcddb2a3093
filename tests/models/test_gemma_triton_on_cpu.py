"""Gemma 2's GPU code path on the CPU: every op on the Triton kernels (Triton's interpreter) against the CPU
engine's path, with W4 weights and an INT8 KV cache: windowed and soft-capped paged attention (decode and
chunked prefill), the GeGLU kernel taking split-K partials, the fused RoPE + KV store, two KV-cache groups."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    # a whole model's GPU path under the interpreter: about a minute each, so `make test-audit` / `make test-all`
    pytest.mark.audit,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                       reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1"),
]


def test_gemma2_triton_path_matches_torch_cpu_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from lightinfer import LLM, SamplingParams
    from lightinfer.kernels import get_backend
    from lightinfer.layers.ops import triton_on_cpu

    # hidden 256: two W4 groups of 128 along K, so the decode GEMVs split K and defer their sums
    transformers.Gemma2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                              sliding_window=24, query_pre_attn_scalar=64, attn_logit_softcapping=1.0,
                              final_logit_softcapping=5.0, architectures=["Gemma2ForCausalLM"]).save_pretrained(tmp_path)
    calls: dict[str, list] = {}
    namespace = get_backend("triton")
    for name in namespace.__all__:
        fn = getattr(namespace, name)

        def counted(*args: object, _fn: object = fn, _name: str = name, **kwargs: object) -> object:
            calls.setdefault(_name, []).append(kwargs)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(namespace, name, counted)
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 17, 40)]  # the last one past the window
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs, logits = [], []
    for on_triton in (False, True):
        # fp32 on both paths (on a CPU, auto would be bf16 with the weights prepared for torch's int4 GEMM)
        llm = LLM(str(tmp_path), load_format="dummy", quantization="awq", dtype="float32", kv_cache_dtype="int8",
                  skip_tokenizer_init=True,
                  num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
        assert llm.llm_engine.model_runner.kv_windows == [None, 24]
        with triton_on_cpu() if on_triton else torch.no_grad():
            outs = llm.generate(prompts, params, use_tqdm=False)
            logits.append(llm.llm_engine.prompt_logits(prompts[2]))
        runs.append([o.outputs[0].token_ids for o in outs])
    torch.testing.assert_close(logits[1], logits[0], atol=2e-3, rtol=2e-3)
    assert runs[1] == runs[0] and all(len(t) == 6 for t in runs[1])
    for op in ("gelu_tanh_and_mul", "rope_store_kvcache", "paged_attention_decode", "paged_attention_prefill"):
        assert calls.get(op), f"the Triton path did not run {op}: {sorted(calls)}"
    decode_kwargs = calls["paged_attention_decode"]
    assert {"window": 24, "softcap": 1.0} in decode_kwargs and {"softcap": 1.0} in decode_kwargs
