"""The GPU code path of a whole model, run on CPU: every layer on the Triton kernels (Triton's CPU
interpreter) instead of their PyTorch twins, through the real engine.

This is what a CUDA device runs, minus CUDA graphs: W4A16 GEMV / tiled with split-K partials left
to the next op, fused add + RMSNorm with the deferred residual, RoPE + INT8 KV store in one op
(``rope_store_kvcache``), paged prefill (chunked) and decode with the whole-page gather. It is compared with the
CPU engine's path (the ``torch_cpu`` backend) on the same weights.
"""

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


def _tiny_dir(tmp_path_factory: pytest.TempPathFactory, arch: str) -> str:
    import transformers

    path = tmp_path_factory.mktemp(f"tiny_{arch}")
    # hidden 256: two quantization groups of 128 along K, so the decode GEMVs split K.
    shape = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
    if arch == "qwen2":  # q/k/v biases: added by the split-K reduction
        transformers.Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    else:
        transformers.LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


class _CountingLaunch:
    """Stands in for a ``@triton.jit`` kernel: counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: object) -> object:
        self.launches += 1
        return self.kernel[grid]


# Each architecture and each KV-cache dtype once: the q/k/v biases live in the GEMMs' split-K reduction and the
# KV dtype in the store / attention kernels, independent of each other (a third, crossed run cost CI ~40 s).
@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "int8"), ("qwen2", "auto")])
def test_triton_path_matches_torch_cpu_path(tmp_path_factory: pytest.TempPathFactory, arch: str, kv_cache_dtype: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from lightinfer import LLM, SamplingParams
    from lightinfer.kernels import SplitKPartials, get_backend
    from lightinfer.kernels import w4a16_gemm as wg
    from lightinfer.layers.ops import triton_on_cpu

    # Count what the Triton path calls, to be sure it is the one that ran.
    calls: dict[str, int] = {}
    namespace = get_backend("triton")
    for name in namespace.__all__:
        fn = getattr(namespace, name)
        def counted(*args: object, _fn: object = fn, _name: str = name, **kwargs: object) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            out = _fn(*args, **kwargs)
            if isinstance(out, SplitKPartials):
                calls["deferred_split_k"] = calls.get("deferred_split_k", 0) + 1
            return out
        monkeypatch.setattr(namespace, name, counted)
    gemv, reduce = _CountingLaunch(wg.w4a16_gemv_kernel), _CountingLaunch(wg.split_k_reduce_kernel)
    monkeypatch.setattr(wg, "w4a16_gemv_kernel", gemv)
    monkeypatch.setattr(wg, "split_k_reduce_kernel", reduce)

    tiny_dir = _tiny_dir(tmp_path_factory, arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (5, 17, 40)]  # one block, crossing, several
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs, logits = [], []
    for on_triton in (False, True):
        # A fresh engine per run: no prefix-cache hit may carry KV from one path into the other.
        # max_num_batched_tokens 32 cuts the 40-token prompt into chunks (prefill over a cached prefix).
        llm = LLM(tiny_dir, load_format="dummy", quantization="awq", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                  skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20, max_model_len=256,
                  max_num_batched_tokens=32, max_num_seqs=4)
        if on_triton:
            with triton_on_cpu():
                outs = llm.generate(prompts, params, use_tqdm=False)
                logits.append(llm.llm_engine.prompt_logits(prompts[2]))
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            logits.append(llm.llm_engine.prompt_logits(prompts[2]))
        runs.append([o.outputs[0].token_ids for o in outs])
    # fp32 on both paths: only the summation order differs (tiles, split-K, online softmax).
    torch.testing.assert_close(logits[1], logits[0], atol=2e-3, rtol=2e-3)
    assert runs[1] == runs[0]
    assert all(len(t) == 6 for t in runs[1])
    # deferred_split_k: qkv/o/gate_up/down GEMMs left their partials to the op that follows (RoPE + KV
    # store, the norms, SiLU), so no split-K reduction kernel ran at all.
    used = {"w4a16_gemm", "rope_store_kvcache", "paged_attention_decode", "paged_attention_prefill", "rms_norm",
            "fused_add_rms_norm", "silu_and_mul", "deferred_split_k"}
    assert used <= {name for name, n in calls.items() if n > 0}, calls
    assert gemv.launches > 0 and reduce.launches == 0
