"""``quantize`` on mixture-of-experts models: experts AWQ-quantized on the calibration tokens routed to them (RTN
below the token threshold, counted in the summary), routers dense, per-expert checkpoint names, and the result
loaded back and run by the engine (INT8 KV too) within a perplexity bound of fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightinfer.evaluate import perplexity
from lightinfer.quant.api import quantize
from lightinfer.quant.awq_moe import MIN_EXPERT_TOKENS
from lightinfer.quant.config import QuantConfig
from tests.models.test_moe_parity import MOE_CASES, moe_checkpoint
from tests.quant.test_quantize import _logits

CALIB = {"num_samples": 8, "seq_len": 128, "group_size": 32}
# Perplexity of the quantized tiny models on held-out text stays within this factor of fp32's (measured:
# at most 1.0036 with AWQ or RTN, INT8 KV or not, over the three families).
PPL_BOUND = 1.01


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lightinfer.quant.calib import get_text

    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(get_text(None, "eval")[:6000])  # the built-in held-out part (never calibration text)
    return str(path)


@pytest.mark.parametrize("case", ["mixtral", "qwen2-moe-shared-expert", "qwen3-moe"])
def test_awq_and_rtn_load_back_within_perplexity_bound(tmp_path: Path, case: str, eval_text: str) -> None:
    src = moe_checkpoint(tmp_path, case)
    ppl = {"fp32": perplexity(str(src), eval_text, max_tokens=500, window=128, dtype="float32").ppl}
    arch = MOE_CASES[case][0]
    for method in ("awq", "rtn"):
        out = tmp_path / method
        summary = quantize(str(src), out, QuantConfig(method=method, format="awq", **CALIB), progress=False)
        num_experts = 8
        assert summary.moe_experts == 2 * num_experts  # two sparse layers
        assert f"experts: {2 * num_experts}" in summary.format()
        if method == "rtn":
            assert summary.moe_rtn_experts == summary.moe_experts
        cfg = json.loads((out / "config.json").read_text())
        block = "block_sparse_moe" if arch == "MixtralForCausalLM" else "mlp"
        gate_proj = "w1" if arch == "MixtralForCausalLM" else "gate_proj"
        assert "gate" in cfg["quantization_config"]["modules_to_not_convert"]
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
            router = f.get_tensor(f"model.layers.1.{block}.gate.weight")
        assert {f"model.layers.1.{block}.experts.7.{gate_proj}.{leaf}" for leaf in ("qweight", "qzeros", "scales")} <= names
        assert router.dtype == torch.float16 and router.shape == (num_experts, 64)  # the router stays dense
        assert not any(".experts." in n and n.endswith(".weight") for n in names)
        for kv in ("auto", "int8"):
            ppl[f"{method}/{kv}"] = perplexity(str(out), eval_text, kv_cache_dtype=kv, max_tokens=500, window=128,
                                               dtype="float32").ppl
    ratios = {k: v / ppl["fp32"] for k, v in ppl.items()}
    assert all(r <= PPL_BOUND for r in ratios.values()), ratios


def test_experts_with_few_routed_tokens_fall_back_to_rtn(tmp_path: Path) -> None:
    src = moe_checkpoint(tmp_path, "qwen3-moe")
    few = quantize(str(src), tmp_path / "few", QuantConfig(num_samples=1, seq_len=16, group_size=32), progress=False)
    # 16 tokens x top-2 over 8 experts: no expert reaches the threshold
    assert few.moe_rtn_experts == few.moe_experts == 16
    many = quantize(str(src), tmp_path / "many", QuantConfig(**CALIB), progress=False)
    assert many.moe_rtn_experts < many.moe_experts
    assert f"quantized with RTN (fewer than {MIN_EXPERT_TOKENS} routed calibration tokens)" in many.format()
    per_layer = [info for info in many.layer_info if "moe.num_experts" in info]
    assert sum(int(i["moe.rtn_experts"]) for i in per_layer) == many.moe_rtn_experts


def _moe_error(awq: bool) -> float:
    """A Qwen3-MoE decoder layer with outlier channels in the experts' shared input: the MoE part (norm, router,
    experts) quantized by ``quantize_moe_block`` on 512 calibration rows, its output error on 256 other rows."""
    import copy

    import transformers

    from lightinfer.models.awq_tables import QWEN3_MOE_TABLE
    from lightinfer.models.qwen3_moe import Qwen3MoeDecoderLayer
    from lightinfer.quant.awq_moe import quantize_moe_block
    from lightinfer.quant.primitives import dequantize

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                      norm_topk_prob=True, num_hidden_layers=1)
    layer = Qwen3MoeDecoderLayer(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        layer.post_attention_layernorm.weight.copy_(1.0 + 0.1 * torch.randn(128))
        layer.post_attention_layernorm.weight[:4] *= 30.0
    x_cal, x_eval = torch.randn(512, 128), torch.randn(256, 128)

    def moe_part(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.mlp(m.post_attention_layernorm(x))

    with torch.no_grad():
        ref = moe_part(layer, x_eval)
        q = copy.deepcopy(layer)
        res = quantize_moe_block(q, QWEN3_MOE_TABLE.moe, [q.post_attention_layernorm(x_cal)], "model.layers.0", 32,
                                 20, 0.5, awq=awq)
        inter = q.mlp.experts.intermediate_size
        for e in range(4):  # the 4-bit weights, dequantized, in place of the folded fp32 ones
            base = f"model.layers.0.mlp.experts.{e}"
            parts = [dequantize(*(res.tensors[f"{base}.{n}.{leaf}"] for leaf in ("qweight", "qzeros", "scales")))
                     for n in ("gate_proj", "up_proj", "down_proj")]
            q.mlp.experts.w13_weight[e, :inter], q.mlp.experts.w13_weight[e, inter:] = parts[0], parts[1]
            q.mlp.experts.w2_weight[e] = parts[2]
        q.mlp.experts.weights_changed()
        return float((moe_part(q, x_eval) - ref).pow(2).mean() / ref.pow(2).mean())


def test_awq_beats_rtn_on_experts_with_outlier_channels() -> None:
    rtn, awq = _moe_error(awq=False), _moe_error(awq=True)
    assert awq < 0.8 * rtn, (awq, rtn)


def test_compressed_tensors_output_of_a_moe_with_biases_loads(tmp_path: Path) -> None:
    """Qwen2-MoE (q/k/v biases, shared expert) written as compressed-tensors: routers and the shared-expert gate
    in ``ignore``, every bias kept, the model loads and matches the AWQ-format output exactly."""
    src = moe_checkpoint(tmp_path, "qwen2-moe-shared-expert")
    for fmt in ("awq", "compressed-tensors"):
        quantize(str(src), tmp_path / fmt, QuantConfig(method="rtn", format=fmt, group_size=32), progress=False)
    cfg = json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(cfg["ignore"])
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_logits(tmp_path / "compressed-tensors", ids), _logits(tmp_path / "awq", ids))
