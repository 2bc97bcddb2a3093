"""The fusion pass changes how a model computes, not what: the fused model (q/k/v and gate/up as
one GEMM, split-K reductions left to the norms, SiLU and RoPE + KV store) gives the unfused
model's logits and tokens, through the engine's paged KV cache (chunked prefill and decode),
on the CPU path and on the Triton path (Triton's CPU interpreter), for every dense family."""

from __future__ import annotations

import os
import random

import pytest
import torch

from lightinfer import LLM, SamplingParams
from lightinfer.engine import model_runner
from lightinfer.layers.fusion import FusionReport
from lightinfer.layers.ops import triton_on_cpu

VOCAB = 320
PROMPTS = [[random.Random(n).randrange(VOCAB) for _ in range(n)] for n in (7, 21)]  # one block; two, chunked


def _tiny_dir(tmp_path_factory: pytest.TempPathFactory, arch: str) -> str:
    import transformers

    path = tmp_path_factory.mktemp(f"tiny_{arch}")
    # Group size 64 (the largest dividing 128 and 192): two or three groups along K, so the GEMVs split K.
    shape = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512}
    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
               "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]
    cfg_cls(**shape, architectures=[arch]).save_pretrained(path)
    return str(path)


def _run(path: str, fuse: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, list[list[int]], LLM]:
    if not fuse:
        monkeypatch.setattr(model_runner, "fuse_model", lambda model: FusionReport())
    # fp32 (not the CPU's low-bit bf16 default): the comparison below holds to fp32 summation order
    llm = LLM(path, load_format="dummy", quantization="awq", dtype="float32", kv_cache_dtype="int8",
              skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=4)
    monkeypatch.undo()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    return llm.llm_engine.prompt_logits(PROMPTS[1]), [o.outputs[0].token_ids for o in outs], llm


def _count_deferred(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the W4A16 GEMMs that hand back split-K partials on the Triton path."""
    from lightinfer.kernels import SplitKPartials, get_backend

    count = [0]
    namespace = get_backend("triton")
    gemm = namespace.w4a16_gemm

    def counted(*args: object, **kwargs: object) -> object:
        out = gemm(*args, **kwargs)
        count[0] += isinstance(out, SplitKPartials)
        return out

    monkeypatch.setattr(namespace, "w4a16_gemm", counted)
    return count


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_fused_model_equals_unfused_on_cpu(tmp_path_factory: pytest.TempPathFactory, arch: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_dir(tmp_path_factory, arch)
    logits_f, tokens_f, llm = _run(path, True, monkeypatch)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None  # it did fuse
    logits_u, tokens_u, llm = _run(path, False, monkeypatch)
    assert llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj is None
    torch.testing.assert_close(logits_f, logits_u, atol=1e-4, rtol=1e-4)
    assert tokens_f == tokens_u and all(len(t) == 3 for t in tokens_f)


@pytest.mark.audit  # the GPU path of whole models under the interpreter: ~45 s each (`make test-audit`)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                    reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1")
# Under the interpreter each architecture costs ~30 s of CI: Qwen2 is Llama's layer plus q/k/v biases (and the
# CPU variant above runs Llama itself), Qwen3 the q/k-norm variant that keeps qkv un-deferred.
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_fused_deferred_model_equals_unfused_on_the_triton_path(tmp_path_factory: pytest.TempPathFactory, arch: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_dir(tmp_path_factory, arch)
    with triton_on_cpu():
        logits_u, tokens_u, _ = _run(path, False, monkeypatch)
        logits_f, tokens_f, llm = _run(path, True, monkeypatch)
        deferred = _count_deferred(monkeypatch)
        llm.llm_engine.prompt_logits(PROMPTS[0])
    # The fused model really left partials to the ops that follow (qkv too, unless Qwen3's q/k norms).
    assert deferred[0] >= 2 * (4 if arch != "Qwen3ForCausalLM" else 3), deferred
    torch.testing.assert_close(logits_f, logits_u, atol=1e-4, rtol=1e-4)
    assert tokens_f == tokens_u and all(len(t) == 3 for t in tokens_f)
