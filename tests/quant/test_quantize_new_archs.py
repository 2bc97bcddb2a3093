"""``quantize`` (AWQ and RTN) on Gemma 2/3 and Phi-3/Phi-4-mini, and the quantized models with an INT8 KV
cache through the engine: perplexity on the tiny random models stays within a stated bound of fp32.

Bounds: INT8 KV alone within 0.5% of the fp32 perplexity, W4 (g32, AWQ or RTN) + INT8 KV within 5%. Measured
(perplexity / fp32 on the 150-token prompt; fp32 perplexities 269-301, near the 272-token vocabulary: random
weights predict almost uniformly, which makes perplexity a blunt probe; the logits check in
``test_quantize.py`` is the sharper one): INT8 KV 1.0000-1.0010; AWQ + INT8 KV 0.981 (Gemma 2), 0.998 (Gemma 3),
1.000 (Phi-3, Phi-4-mini); RTN + INT8 KV 1.006, 1.003, 1.000, 0.999."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightinfer import LLM
from lightinfer.quant.api import quantize
from lightinfer.quant.config import QuantConfig
from tests.models.arch_cases import prompts, write_case

FAST = {"num_samples": 4, "seq_len": 64}
KV_INT8_BOUND = 0.005
W4_INT8_BOUND = 0.05


def _ppl(path: Path, ids: list[int], **engine: object) -> float:
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=64, num_kv_blocks=32, **engine)
    return math.exp(-float(llm.llm_engine.score(ids).mean()))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-longrope", "phi4mini-partial-rotary"])
def test_quantized_models_run_with_int8_kv_within_the_bound(tmp_path: Path, name: str) -> None:
    src = write_case(tmp_path / "src", name)
    ids = prompts(name)[-1]
    fp32 = _ppl(src, ids)
    assert abs(_ppl(src, ids, kv_cache_dtype="int8") / fp32 - 1) < KV_INT8_BOUND
    for method in ("awq", "rtn"):
        out = tmp_path / method
        summary = quantize(str(src), out, QuantConfig(method=method, group_size=32, **FAST), progress=False)
        assert summary.num_layers > 0 and summary.linear_ratio < 0.35
        ppl = _ppl(out, ids, kv_cache_dtype="int8")
        assert abs(ppl / fp32 - 1) < W4_INT8_BOUND, f"{name} {method}: perplexity {ppl:.2f} vs fp32 {fp32:.2f}"


def test_awq_folds_gemma_norms_and_phi3_gate_up_exactly(tmp_path: Path) -> None:
    """Folding AWQ's scales changes no full-precision output: Gemma's norms scale by 1 + weight (the fold divides
    that), Phi-3's down_proj reads the up half (the last rows) of gate_up_proj."""
    from lightinfer.layers.attention import no_cache_context
    from lightinfer.loader import Checkpoint
    from lightinfer.models.registry import get_model_class
    from lightinfer.quant.awq import quantize_layer

    for name in ("gemma3", "phi3-longrope"):
        ck = Checkpoint(str(write_case(tmp_path / name, name)))
        cls = get_model_class(ck.hf_config)
        layer = cls.decoder_layer_cls(ck.hf_config, 1, quant_config=None, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in layer.named_parameters():
                p.copy_(ck.get_tensor(f"model.layers.1.{pname}"))
        x = torch.randn(2 * 32, ck.hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
        pos, cu = torch.arange(32).repeat(2), torch.tensor([0, 32, 64], dtype=torch.int32)
        with torch.no_grad(), no_cache_context(cu):
            before = layer(pos, x)
        # grid 20 points, no clipping: the scales are folded, the weights quantized only in the returned tensors
        _, outs, info = quantize_layer(layer, cls.awq_table, [x], 32, 32, 20, 0.0, "model.layers.1")
        assert any(v > 0 for k, v in info.items() if k.endswith(".alpha")), info  # some scale was folded
        with torch.no_grad(), no_cache_context(cu):
            after = layer(pos, x)
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[0], before)
