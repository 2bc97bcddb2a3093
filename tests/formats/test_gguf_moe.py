"""A Qwen3-MoE GGUF (experts stacked per projection, llama.cpp's layout) loads straight into the stacked experts:
4-bit types as W4 (Q4_K's fractional zeros kept), other types dense; logits equal transformers reading the same
file; and the GPU code path (Triton interpreter) agrees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from lightinfer import LLM
from lightinfer.formats.gguf_file import open_gguf
from lightinfer.layers.moe import FusedMoE
from lightinfer.loader import Checkpoint, load_weights
from lightinfer.models.registry import get_model_class
from tests.formats.gguf_files import write_tiny_qwen3moe_gguf

# Q4_K_M-like: gate/up experts Q4_K, down experts Q6_K (or Q4_1 in the second case), attention and head mixed.
MIX = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K, "attn_q": T.Q4_K, "attn_v": T.Q6_K,
       "token_embd": T.Q8_0, "output": T.Q6_K}


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = open_gguf(str(path)).config  # transformers' config with the expert width the file states
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    hf = Qwen3MoeForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("down", [T.Q6_K, T.Q4_1])
def test_logits_match_transformers_on_the_same_file(tmp_path: Path, down: T) -> None:
    path = write_tiny_qwen3moe_gguf(tmp_path / "m.gguf", {**MIX, "ffn_down_exps": down})
    assert open_gguf(str(path)).config.moe_intermediate_size == 256  # from the file, not transformers' default
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=16)
    ids = list(range(3, 60))
    want = _hf_logits(path, ids)
    got = llm.llm_engine.prompt_logits(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    weights = llm.llm_engine.model_info()["weights"]
    assert weights["gate_exps"] == weights["up_exps"] == "W4 (GGUF Q4_K, g32)"
    moe = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert all(m.group_size == 32 for m in moe)
    if down == T.Q6_K:  # 8-bit-ish experts: dequantized once into a dense stack
        assert weights["down_exps"] == "dense (GGUF Q6_K)" and not moe[0].is_quantized("w2")
    else:
        assert weights["down_exps"] == "W4 (GGUF Q4_1, g32)" and moe[0].is_quantized("w2")
        # the engine released its W4 stacks for the CPU copy (FusedMoE.pack_for_cpu): look at a plain load
        assert moe[0].released and moe[0].w2_zeros.is_meta
        ck = Checkpoint(str(path))
        model = get_model_class(ck.hf_config)(ck.hf_config, ck.quant_config, torch.float32)
        load_weights(model, ck)
        loaded = next(m for m in model.modules() if isinstance(m, FusedMoE))
        assert bool((loaded.w2_zeros != loaded.w2_zeros.round()).any())  # Q4_1: fractional zeros, kept


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_path_keeps_fractional_zeros(tmp_path: Path) -> None:
    from lightinfer.layers.ops import triton_on_cpu

    # only the experts quantized: the dense W4 GEMMs' fractional zeros are another matter (kernels/w4_decode.py)
    experts = {"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q4_1}
    path = write_tiny_qwen3moe_gguf(tmp_path / "m.gguf", experts, layers=1)
    with triton_on_cpu():  # built under the Triton path: no CPU preparation releases the stacks it reads
        llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=8)
        got = llm.llm_engine.prompt_logits(ids := list(range(3, 20)))
    want = llm.llm_engine.prompt_logits(ids)  # torch_cpu, its copy made by this first forward
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_quantize_from_a_moe_gguf_equals_quantize_from_the_same_weights(tmp_path: Path) -> None:
    """``quantize`` reads a MoE GGUF's stacked experts as per-expert tensors: RTN of the GGUF gives exactly the
    tensors RTN gives from a Hugging Face folder holding the same weights (per-expert names, as transformers
    saves them)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from lightinfer.quant.api import quantize
    from lightinfer.quant.config import QuantConfig
    from tests.conftest import _save_tokenizer

    path = write_tiny_qwen3moe_gguf(tmp_path / "m.gguf", {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_1,
                                                         "ffn_down_exps": T.Q8_0, "attn_q": T.Q8_0})
    cfg = open_gguf(str(path)).config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    hf = Qwen3MoeForCausalLM(cfg)
    hf.load_state_dict(load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"])
    hf.config.architectures = ["Qwen3MoeForCausalLM"]
    hf.save_pretrained(tmp_path / "hf")
    _save_tokenizer(tmp_path / "hf", 272)
    for src, out in ((path, "q_gguf"), (tmp_path / "hf", "q_hf")):
        summary = quantize(str(src), tmp_path / out, QuantConfig(method="rtn", format="awq"), progress=False)
        assert summary.moe_experts == 8
    with safe_open(str(tmp_path / "q_gguf" / "model.safetensors"), framework="pt") as a, \
            safe_open(str(tmp_path / "q_hf" / "model.safetensors"), framework="pt") as b:
        names = set(a.keys())
        assert names == set(b.keys())
        assert "model.layers.1.mlp.experts.3.down_proj.qweight" in names
        for name in names:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
