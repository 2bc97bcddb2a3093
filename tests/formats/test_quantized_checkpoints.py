"""GPTQ (GPTQModel) and compressed-tensors (the compressed-tensors library) checkpoints made by the real tools
(``tests/fixtures/make_quant_fixtures.py``) load into the W4 / W8 layouts: the dequantized weights equal the
tool's own dequantization within fp16 rounding, and the logits the tool's own forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightinfer import LLM
from lightinfer.layers.linear import W4A16Linear
from lightinfer.layers.w8_linear import W8A16Linear
from lightinfer.loader import Checkpoint, load_weights
from lightinfer.models.registry import get_model_class
from tests.fixtures.make_quant_fixtures import REF_IDS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "quant"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.safetensors").is_file())


def _load(path: Path) -> tuple[torch.nn.Module, dict[str, str]]:
    ck = Checkpoint(path)
    model = get_model_class(ck.hf_config)(ck.hf_config, ck.quant_config, torch.float32)
    return model, load_weights(model, ck)


def test_every_fixture_is_present() -> None:
    assert {"gptq-4bit-g32-sym", "gptq-4bit-g32-asym-actorder", "gptq-4bit-g128-sym-actorder-v2",
            "gptq-4bit-channel-asym", "gptq-8bit-g32-asym", "ct-4bit-g32-sym", "ct-4bit-g64-asym",
            "ct-4bit-channel-asym"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_weights_equal_the_tools_dequantization(name: str) -> None:
    model, report = _load(FIXTURES / name)
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    modules = dict(model.named_modules())
    checked = 0
    for key, want in ref.items():
        if key == "logits":
            continue
        layer = modules[key[: -len(".weight")]]
        assert isinstance(layer, W8A16Linear if "8bit" in name else W4A16Linear)
        got = layer.dense_weight().float()
        err = (got - want.float()).abs()
        assert bool((err <= 2**-11 * want.float().abs() + 1e-6).all()), (key, float(err.max()))  # fp16 rounding
        checked += 1
    assert checked == 2
    kind = "W8" if "8bit" in name else "W4"
    tool = "GPTQ" if name.startswith("gptq") else "compressed-tensors"
    assert report["model.layers.0.mlp.down_proj"].startswith(f"{kind} ({tool}, ")
    if "actorder" in name:  # down_proj (K = intermediate) has several groups: its K is reordered
        assert modules["model.layers.0.mlp.down_proj"].input_perm is not None
        assert "act-order" in report["model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_the_tools_forward(name: str) -> None:
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))["logits"]
    llm = LLM(str(FIXTURES / name), dtype="float32", max_model_len=64, num_kv_blocks=8)
    got = llm.llm_engine.prompt_logits(REF_IDS)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert llm.llm_engine.model_info()["quantization"]["method"] in ("gptq", "compressed-tensors")


def test_act_order_runs_the_gathered_order_on_the_triton_path() -> None:
    """The GPU path gathers the input in the stored K order: same result as the CPU path's un-permuted weight."""
    from lightinfer.layers.ops import triton_on_cpu

    model, _ = _load(FIXTURES / "gptq-4bit-g32-asym-actorder")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.input_perm is not None
    x = torch.randn(3, layer.in_features)
    want = x @ layer.dense_weight().t()
    with triton_on_cpu():
        got = layer(x)
    got = got.reduced() if hasattr(got, "reduced") else got
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ bad input
def _copy(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensor(path: Path, name: str, fn) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def no_model_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fails the test's LLM() if it gets as far as building the model (errors must come first)."""
    built: list[int] = []
    monkeypatch.setattr("lightinfer.engine.model_runner.ModelRunner.__init__", lambda *a, **k: built.append(1))
    return built


def test_gptq_g_idx_not_covering_every_group(tmp_path: Path, no_model_built: list[int]) -> None:
    path = _copy(tmp_path, "gptq-4bit-g32-asym-actorder")
    _edit_tensor(path, "model.layers.1.mlp.down_proj.g_idx", lambda g: torch.zeros_like(g))
    with pytest.raises(ValueError, match=r"model\.safetensors: model\.layers\.1\.mlp\.down_proj\.g_idx does not "
                                         r"cover every group"):
        LLM(str(path))
    assert not no_model_built


def test_gptq_3bit_refused(tmp_path: Path, no_model_built: list[int]) -> None:
    path = _copy(tmp_path, "gptq-4bit-g32-sym")
    _edit_config(path, bits=3)
    with pytest.raises(ValueError, match=r"config\.json: quantization_config\.bits=3 is not supported.*4-bit.*8-bit"):
        LLM(str(path))
    assert not no_model_built


@pytest.mark.parametrize("name,tensor", [("gptq-4bit-g32-sym", "model.layers.1.self_attn.o_proj.scales"),
                                         ("ct-4bit-g32-sym", "model.layers.1.self_attn.o_proj.weight_scale")])
def test_nan_scales_name_the_layer(tmp_path: Path, no_model_built: list[int], name: str, tensor: str) -> None:
    path = _copy(tmp_path, name)

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = float("inf")
        return t

    _edit_tensor(path, tensor, poison)
    with pytest.raises(ValueError, match=rf"{tensor.replace('.', '[.]')} holds 1 NaN/inf.*layer "
                                         r"model\.layers\.1\.self_attn\.o_proj"):
        LLM(str(path))
    assert not no_model_built


@pytest.mark.parametrize("change,match", [
    ({"rotation": "hadamard"}, r"quantization_config\.rotation='hadamard' is not supported"),
    ({"dynamic": {"-:.*down_proj": {}}}, r"quantization_config\.dynamic=.* is not supported"),
    ({"hqq_offsets": True}, (r"key\(s\) 'hqq_offsets' unknown to lightinfer's reader of "
                             r"quantization_config\.quant_method='gptq'")),
    ({"checkpoint_format": "marlin", "format": "marlin"}, r"checkpoint_format/format=\['marlin'\]"),
])
def test_gptq_config_keys_that_change_meaning(tmp_path: Path, no_model_built: list[int], change: dict,
                                              match: str) -> None:
    path = _copy(tmp_path, "gptq-4bit-g32-sym")
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=match):
        LLM(str(path))
    assert not no_model_built


@pytest.mark.parametrize("change,match", [
    ({"format": "int-quantized"}, r"quantization_config\.format='int-quantized' is not supported.*pack-quantized"),
    ({"format": "float-quantized"}, r"quantization_config\.format='float-quantized' is not supported"),
    ({"kv_cache_scheme": {"num_bits": 8}}, r"kv_cache_scheme"),
    ({"weight_transform": "x"}, (r"unknown to lightinfer's reader of quantization_config\.quant_method="
                                 r"'compressed-tensors'")),
])
def test_compressed_tensors_config_refused(tmp_path: Path, no_model_built: list[int], change: dict,
                                           match: str) -> None:
    path = _copy(tmp_path, "ct-4bit-g32-sym")
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=match):
        LLM(str(path))
    assert not no_model_built


def test_compressed_tensors_activation_quantization_refused(tmp_path: Path, no_model_built: list[int]) -> None:
    path = _copy(tmp_path, "ct-4bit-g32-sym")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"group_0\.input_activations is set: activation quantization"):
        LLM(str(path))
    assert not no_model_built


def test_act_order_layers_sharing_an_input_fuse_with_one_gather() -> None:
    """GPTQModel orders q/k/v (and gate/up) by the same Hessian, so they share one K order: fused, they
    gather their common input once."""
    llm = LLM(str(FIXTURES / "gptq-4bit-g32-asym-actorder"), dtype="float32", max_model_len=64, num_kv_blocks=8)
    attn = llm.llm_engine.model_runner.model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and attn.qkv_proj.input_perm is not None
