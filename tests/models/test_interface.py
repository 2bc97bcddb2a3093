"""The model interface (models/base.py) and the models' import boundary."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers

from lightinfer.layers.weight_forms import PackedDenseWeight
from lightinfer.models.base import CausalLM
from lightinfer.models.llama import head_dim_of
from lightinfer.models.registry import MODEL_REGISTRY, get_model_class, quantizable_architectures

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
# What models/ may import: the layers, each other, torch and a few standard modules.
ALLOWED = ("lightinfer.layers", "lightinfer.models", "torch", "__future__", "abc", "dataclasses", "typing")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_models_import_only_layers_and_torch() -> None:
    files = sorted(MODELS_DIR.glob("*.py"))
    assert len(files) >= 5
    bad = {f.name: name for f in files for name in _imports(f)
           if not any(name == a or name.startswith(a + ".") for a in ALLOWED)}
    assert bad == {}, f"models/ must import only lightinfer.layers (and torch): {bad}"


def test_models_hold_no_kernel_tricks() -> None:
    for f in MODELS_DIR.glob("*.py"):
        text = f.read_text()
        for trick in ("SplitKPartials", "defer_reduce", "fuse_linears", "W4A16Linear", "lightinfer.kernels"):
            assert trick not in text, f"{f.name} mentions {trick}: that belongs in layers/ (layers/fusion.py)"


MOE_CONFIGS = {"MixtralForCausalLM": (transformers.MixtralConfig, {"num_local_experts": 4}),
               "Qwen2MoeForCausalLM": (transformers.Qwen2MoeConfig, {"num_experts": 4, "moe_intermediate_size": 64,
                                                                     "shared_expert_intermediate_size": 96}),
               "Qwen3MoeForCausalLM": (transformers.Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 64})}
DENSE_ARCHS = sorted(set(MODEL_REGISTRY) - set(MOE_CONFIGS))


DENSE_CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
                 "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
                 "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
                 "Phi3ForCausalLM": "Phi3Config"}


def _config(arch: str, **extra: object) -> object:
    if arch in DENSE_CONFIGS:
        cls = getattr(transformers, DENSE_CONFIGS[arch])
    else:
        cls, moe = MOE_CONFIGS[arch]
        extra = {**moe, "num_experts_per_tok": 2, **extra}
    cfg = cls(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=32, **{"tie_word_embeddings": False, **extra})
    cfg.architectures = [arch]
    return cfg


@pytest.mark.parametrize("arch", sorted(MOE_CONFIGS))
def test_moe_classes_implement_the_interface(arch: str) -> None:
    from lightinfer.layers.moe import FusedMoE

    cfg = _config(arch)
    cls = get_model_class(cfg)
    assert issubclass(cls, CausalLM) and cls.awq_table is not None and cls.awq_table.moe is not None
    with torch.device("meta"):
        model = cls(cfg, None, torch.float32)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert cls.moe_layer_ids(cfg) == [0, 1] and len(experts) == 2
    i = 160 if arch == "MixtralForCausalLM" else 64
    assert experts[0].w13_weight.shape == (4, 2 * i, 96) and experts[0].w2_weight.shape == (4, 96, i)
    sizes = cls.linear_input_sizes(cfg)
    assert sizes["hidden_size"] == 96 and i in sizes.values()
    parts = cls.weight_bytes_by_part(cfg, bits=16, dtype_bytes=2)
    assert parts["experts"] == 2 * 4 * 3 * i * 96 * 2
    assert sum(parts.values()) == sum(t.numel() * 2 for t in model.state_dict().values())
    assert arch in quantizable_architectures()


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_every_registered_class_implements_the_interface(arch: str) -> None:
    cfg = _config(arch)
    cls = get_model_class(cfg)
    assert issubclass(cls, CausalLM) and cls.awq_table is not None
    with torch.device("meta"):
        model = cls(cfg, None, torch.float32)
    assert model.config is cfg and model.tie_word_embeddings is False
    assert model.embed_tokens.weight.shape == (128, 96)
    t = 3
    with torch.device("meta"):  # shapes only: the attention path is exercised by the engine tests
        logits = model.compute_logits(torch.empty(t, 96))
    assert logits.shape == (t, 128) and logits.dtype == torch.float32
    # The shapes the quantizer uses, exactly those of the hand-written table it replaced.
    h, i, q, kv = 96, 160, 6 * 32, 2 * 32
    if arch == "Phi3ForCausalLM":  # q/k/v and gate/up fused on disk
        want = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q), "mlp.gate_up_proj": (2 * i, h),
                "mlp.down_proj": (h, i)}
    else:
        want = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    assert cls.decoder_linear_shapes(cfg) == want
    # every linear is in the AWQ table, except Phi-3's o_proj (no qkv_proj -> o_proj group, as AutoAWQ)
    assert set(cls.awq_table.linears) == set(want) - ({"self_attn.o_proj"} if arch == "Phi3ForCausalLM" else set())
    assert cls.linear_input_sizes(cfg) == {"hidden_size": 96, "intermediate_size": 160,
                                           "num_attention_heads * head_dim": 6 * head_dim_of(cfg)}
    assert arch in quantizable_architectures()
    with torch.device("meta"):
        dense = cls(cfg, None, torch.float16)
    parts = cls.weight_bytes_by_part(cfg, bits=16, dtype_bytes=2)  # arithmetic = what the built model holds
    assert sum(parts.values()) == sum(t.numel() * 2 for t in dense.state_dict().values()) and parts["experts"] == 0


def test_the_default_linear_input_sizes_come_from_the_layer() -> None:
    cfg = _config("LlamaForCausalLM")
    sizes = CausalLM.linear_input_sizes.__func__(get_model_class(cfg), cfg)
    assert sizes["self_attn.o_proj.in_features"] == 6 * 32 and sizes["mlp.down_proj.in_features"] == 160
    assert len(sizes) == 7


def test_an_incomplete_model_class_cannot_be_built() -> None:
    class NoLogits(CausalLM):
        def forward(self, input_ids, positions, inputs_embeds=None):  # type: ignore[no-untyped-def]
            return positions

        @property
        def embed_tokens(self):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(TypeError, match="compute_logits"):
        NoLogits()


def test_pack_for_cpu_packs_every_linear_and_keeps_a_tied_head() -> None:
    from lightinfer.dummy_weights import init_dummy_weights
    from lightinfer.layers.cpu_gemm import onednn_gemm_available

    if not onednn_gemm_available():
        pytest.skip("no prepacked oneDNN GEMM in this torch build")
    cfg = _config("LlamaForCausalLM", tie_word_embeddings=True)
    model = get_model_class(cfg)(cfg, None, torch.float32)
    init_dummy_weights(model, seed=0)
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert len(linears) == 14
    model.pack_for_cpu()
    assert all(isinstance(m.weight_impl, PackedDenseWeight) and m.weight is None for m in linears)
    assert isinstance(model.lm_head.weight_impl, PackedDenseWeight)
    assert model.lm_head.weight is model.embed_tokens.weight  # the embedding still reads it
