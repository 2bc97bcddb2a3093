"""Config sizes are checked before anything is built (issue 19 items 6 and 7), and the memory estimate is
arithmetic: a corrupt config fails in one ``error:`` line naming the file and the field, at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers

from lightinfer.cli import main
from lightinfer.engine.memory import module_bytes
from lightinfer.layers.cpu_gemm import use_cpu_lowbit
from lightinfer.layers.moe import FusedMoE
from lightinfer.models.base import CausalLM
from lightinfer.models.config_check import check_decoder_sizes
from lightinfer.models.registry import MODEL_REGISTRY, get_model_class, validate_model_config

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def _folder(tmp_path: Path, **over: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**BASE, **over}))
    return folder


@pytest.mark.parametrize("over, message", [
    ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be a positive integer"),  # ZeroDivisionError
    ({"hidden_size": -64}, "hidden_size is -64; it must be a positive integer"),  # negative dimension
    ({"intermediate_size": -1}, "intermediate_size is -1; it must be a positive integer"),
    ({"hidden_size": 10**9}, "hidden_size is 1,000,000,000, beyond any real model"),  # 22 billion GiB "needed"
    ({"num_hidden_layers": 1_000_000}, "num_hidden_layers is 1,000,000, beyond any real model"),  # minutes, ~9 GB
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),  # deep in SDPA
    ({"vocab_size": 0}, "vocab_size is 0"),  # oneDNN "could not create a primitive descriptor"
    ({"hidden_size": "64"}, "hidden_size is '64'; it must be a positive integer"),
    ({"hidden_size": 66}, "hidden_size=66 is not a multiple of num_attention_heads=4"),
    ({"head_dim": 15, "hidden_size": 60}, "rotary embeddings need an even head size"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported by LlamaForCausalLM"),  # the architecture's hook
    ({"rms_norm_eps": -1}, "rms_norm_eps is -1"),
])
def test_bad_sizes_fail_fast_in_one_line(tmp_path: Path, capsys, over: dict, message: str) -> None:
    folder = _folder(tmp_path, **over)
    t = time.perf_counter()
    assert main(["generate", str(folder), "--dummy-weights", "--prompt-ids", "1,2", "--max-tokens", "2"]) == 2
    # the load's progress lines ("lightinfer: [  0.0 s] reading ...") aside, one error line
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                  if not line.startswith("lightinfer: ["))
    assert time.perf_counter() - t < 10
    assert err.startswith(f"error: {folder / 'config.json'}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_config_json_that_is_not_an_object(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    assert main(["generate", str(folder), "--dummy-weights", "--prompt-ids", "1"]) == 2
    assert "must hold a JSON object" in capsys.readouterr().err
    (folder / "config.json").write_text("{not json")
    assert main(["generate", str(folder), "--dummy-weights", "--prompt-ids", "1"]) == 2
    assert "is not readable JSON" in capsys.readouterr().err


def test_the_checks_take_raw_dicts_and_transformers_configs() -> None:
    raw = {**BASE, "num_attention_heads": 0}
    with pytest.raises(ValueError, match="where.json: num_attention_heads is 0"):
        validate_model_config(raw, "where.json")
    cfg = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")})
    cfg.architectures = ["LlamaForCausalLM"]
    validate_model_config(cfg, "ok.json")  # a sane config passes
    cfg.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3 does not divide"):
        validate_model_config(cfg, "x")
    # GGUF files name the fields by their metadata keys
    with pytest.raises(ValueError, match="llama.attention.head_count is 0"):
        check_decoder_sizes({"num_attention_heads": 0}, "f.gguf", {"num_attention_heads": "llama.attention.head_count"})
    validate_model_config({"architectures": ["SomethingElse"], "hidden_size": -1}, "x")  # left to get_model_class


# Sizes of the MoE families' experts (Qwen2-MoE: a shared expert, and layer 1 dense through mlp_only_layers).
_MOE_SIZES: dict[str, dict[str, object]] = {
    "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    "Qwen2MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                            "shared_expert_intermediate_size": 256, "mlp_only_layers": [1]},
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def _llama_like(arch: str, **extra: object) -> object:
    name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(arch, arch.replace("ForCausalLM", "Config"))
    cls = getattr(transformers, name)
    cfg = cls(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, **_MOE_SIZES.get(arch, {}), **extra)
    cfg.architectures = [arch]
    return cfg


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_estimate_matches_the_built_model(arch: str, quantized: bool, tied: bool) -> None:
    """The arithmetic estimate is within 1% of the bytes of the model built on the meta device."""
    from lightinfer.dummy_weights import dummy_awq_config

    cfg = _llama_like(arch, tie_word_embeddings=tied)
    cls = get_model_class(cfg)
    qc = dummy_awq_config(cfg) if quantized else None
    for dtype in (torch.float32, torch.float16):
        with torch.device("meta"):
            model = cls(cfg, qc, dtype)
        real = module_bytes(model)
        estimate, dense = cls.estimate_weight_bytes(cfg, qc, dtype)
        assert abs(estimate - real) <= 0.01 * real, (estimate, real)
        elem = torch.empty(0, dtype=dtype).element_size()
        want_dense = 0 if use_cpu_lowbit(dtype) else sum(m.in_features * m.out_features * elem for m in model.modules()
                                                         if type(m).__name__ in ("W4A16Linear", "W8A16Linear"))
        # What the MoE experts' CPU copy adds beyond the W4 stacks it releases, by the kernel's rule on each built
        # layer's stacks (tests/layers/test_moe_layout.py holds that rule to what the CPU preparation makes):
        # prepacked fp32 less the W4 stacks for fp32 engines, 0 for 16-bit ones (int4 codes plus scale/offset
        # pairs: the stacks' size; dense 16-bit experts: none).
        want_dense += sum(m.cpu_copy_nbytes() for m in model.modules() if isinstance(m, FusedMoE))
        assert dense == want_dense


def test_estimate_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU memory check used to build every layer on the meta device: minutes and ~9 GB for a million
    layers. The estimate is arithmetic: the model class is never instantiated."""
    cfg = _llama_like("LlamaForCausalLM")
    cfg.num_hidden_layers = 1024
    cls = get_model_class(cfg)

    def no_build(*_: object, **__: object) -> None:
        raise AssertionError("the estimate built a module")

    monkeypatch.setattr(cls, "__init__", no_build)
    monkeypatch.setattr(cls.decoder_layer_cls, "__init__", no_build)
    t = time.perf_counter()
    weights, _ = cls.estimate_weight_bytes(cfg, None, torch.float32)
    assert weights > 1024 * 7 * 256 * 256 * 4 * 0.5 and time.perf_counter() - t < 2


def test_subclasses_extend_the_hook() -> None:
    class Strict(get_model_class(_llama_like("LlamaForCausalLM"))):
        @classmethod
        def validate_config(cls, hf_config, where, field_names=None):  # type: ignore[no-untyped-def]
            super().validate_config(hf_config, where, field_names)
            if getattr(hf_config, "num_hidden_layers", 0) % 2:
                raise ValueError(f"{where}: an even number of layers, please")

    assert issubclass(Strict, CausalLM)
    with pytest.raises(ValueError, match="an even number"):
        Strict.validate_config(_llama_like("LlamaForCausalLM"), "x")
    with pytest.raises(ValueError, match="num_attention_heads is 0"):
        Strict.validate_config({"num_attention_heads": 0}, "x")
