"""AWQ internals on tiny random layers: the fold preserves the function, the search never
loses to RTN, the Gram and token forms of the loss agree, outlier channels are protected."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig

from lightinfer.layers.attention import no_cache_context
from lightinfer.models.llama import LlamaForCausalLM
from lightinfer.models.registry import get_model_class
from lightinfer.quant.awq import InputStats, quantize_layer, search_scales
from lightinfer.quant.primitives import dequantize, fake_quantize


def _layer(num_kv_heads: int, arch: str = "LlamaForCausalLM", seed: int = 0) -> tuple[torch.nn.Module, object]:
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                      num_hidden_layers=1, vocab_size=64, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    layer = get_model_class(cfg).decoder_layer_cls(cfg, 0, quant_config=None, dtype=torch.float32)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        layer.input_layernorm.weight[:4] *= 25.0  # activation outlier channels, as in real LLMs
        layer.post_attention_layernorm.weight[5:8] *= 25.0
    return layer, cfg


def _run(layer: torch.nn.Module, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = x.shape[0] // seq_len
    cu = torch.arange(n + 1, dtype=torch.int32) * seq_len
    with torch.no_grad(), no_cache_context(cu):
        return layer(torch.arange(seq_len).repeat(n), x)


def _with_weights(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> torch.nn.Module:
    """A copy of ``layer`` whose quantized linears carry the dequantized 4-bit weights."""
    q = copy.deepcopy(layer)
    with torch.no_grad():
        for name, m in q.named_modules():
            key = f"{prefix}.{name}.qweight"
            if key in tensors:
                m.weight.copy_(dequantize(tensors[key], tensors[f"{prefix}.{name}.qzeros"],
                                          tensors[f"{prefix}.{name}.scales"]))
    return q


@pytest.mark.parametrize("num_kv_heads", [4, 2])  # 4: v->o fold used; 2 (GQA): skipped
def test_fold_preserves_function_and_awq_beats_rtn(num_kv_heads: int) -> None:
    layer, cfg = _layer(num_kv_heads)
    table = LlamaForCausalLM.awq_table
    seq_len = 32
    x = torch.randn(8 * seq_len, cfg.hidden_size)
    ref = _run(layer, x, seq_len)
    rtn = copy.deepcopy(layer)
    with torch.no_grad():
        for name in table.linears:
            m = rtn.get_submodule(name)
            m.weight.copy_(fake_quantize(m.weight, 32))
    awq_layer = copy.deepcopy(layer)
    tensors, outputs, info = quantize_layer(awq_layer, table, [x[: 4 * seq_len], x[4 * seq_len :]], seq_len,
                                            32, 20, 0.5, "model.layers.0")
    # the layer's fp output on the calibration batch feeds the next layer
    assert torch.allclose(torch.cat(outputs), ref, atol=1e-5)
    # folding the scales (and nothing else) leaves the full-precision function unchanged
    assert torch.allclose(_run(awq_layer, x, seq_len), ref, rtol=1e-4, atol=1e-4)
    assert ("self_attn.o_proj.alpha" in info) == (num_kv_heads == cfg.num_attention_heads)
    assert all(v <= 1.0 + 1e-6 for k, v in info.items() if k.endswith("loss_ratio"))
    assert info["self_attn.q_proj.alpha"] > 0  # the outlier channels were protected
    err_awq = (_run(_with_weights(awq_layer, tensors, "model.layers.0"), x, seq_len) - ref).pow(2).mean()
    err_rtn = (_run(rtn, x, seq_len) - ref).pow(2).mean()
    assert float(err_awq) < 0.8 * float(err_rtn), (float(err_awq), float(err_rtn))
    assert {k.rsplit(".", 1)[1] for k in tensors} >= {"qweight", "qzeros", "scales", "weight"}
    assert not any(k.endswith(("q_proj.weight", "down_proj.weight")) for k in tensors)


def test_gram_and_token_losses_agree() -> None:
    torch.manual_seed(1)
    x = torch.randn(40, 64) * torch.linspace(0.1, 5.0, 64)
    w = torch.randn(16, 64)
    gram = InputStats(abs_sum=torch.zeros(64, dtype=torch.float64), gram=torch.zeros(64, 64, dtype=torch.float64))
    rows = InputStats(abs_sum=torch.zeros(64, dtype=torch.float64), gram=None)
    for part in x.split(16):
        gram.add(part)
        rows.add(part)
    a = search_scales([w], gram, 32, 20)
    b = search_scales([w], rows, 32, 20)
    assert a[1] == b[1] and torch.allclose(a[0], b[0])
    assert a[2] == pytest.approx(b[2], rel=1e-4) and a[3] == pytest.approx(b[3], rel=1e-4)
    assert torch.allclose(gram.group_blocks(32), rows.group_blocks(32), rtol=1e-4, atol=1e-4)


def test_nan_weight_is_reported_with_its_name() -> None:
    layer, cfg = _layer(4)
    with torch.no_grad():
        layer.mlp.up_proj.weight[0, 0] = float("inf")
    x = torch.randn(64, cfg.hidden_size)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        quantize_layer(layer, LlamaForCausalLM.awq_table, [x], 32, 32, 20, 0.5, "model.layers.0")
