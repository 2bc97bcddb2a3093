"""``lightinfer quantize --format compressed-tensors|awq``: both formats hold the same numbers, and the
compressed-tensors checkpoint has llm-compressor's layout (the shapes and config its readers expect)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightinfer import LLM
from lightinfer.cli import main as cli_main
from lightinfer.formats.ct_writer import awq_to_compressed_tensors
from lightinfer.quant.api import quantize
from lightinfer.quant.config import QuantConfig
from tests.conftest import write_tiny_checkpoint

FAST = {"num_samples": 2, "seq_len": 64}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ct")
    src = write_tiny_checkpoint(root / "src", intermediate_size=192)
    ct, awq = root / "ct", root / "awq"
    quantize(str(src), ct, QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "down_proj"], **FAST),
             progress=False)
    quantize(str(src), awq, QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "down_proj"],
                                        format="awq", **FAST), progress=False)
    return ct, awq


def test_default_is_compressed_tensors_with_llm_compressors_layout(both: tuple[Path, Path]) -> None:
    ct, _ = both
    qc = json.loads((ct / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert weights == {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
                       "dynamic": False, "actorder": None, "block_structure": None}
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert "lm_head" in qc["ignore"] and "model.layers.1.mlp.down_proj" in qc["ignore"]
    with safe_open(str(ct / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        p = "model.layers.1.mlp.up_proj"
        assert f.get_tensor(f"{p}.weight_packed").dtype == torch.int32
        assert tuple(f.get_tensor(f"{p}.weight_packed").shape) == (192, 64 // 8)  # [out, in / 8]
        assert tuple(f.get_tensor(f"{p}.weight_scale").shape) == (192, 64 // 32)  # [out, in / G]
        assert tuple(f.get_tensor(f"{p}.weight_zero_point").shape) == (192 // 8, 64 // 32)  # packed along out
        assert f.get_tensor(f"{p}.weight_shape").tolist() == [192, 64]
    assert not any(n.endswith((".qweight", ".qzeros", ".scales")) for n in names)
    assert "model.layers.1.mlp.down_proj.weight" in names


def test_both_formats_load_to_the_same_model(both: tuple[Path, Path]) -> None:
    ct, awq = both
    ids = list(range(5, 60))
    a = LLM(str(ct), dtype="float32", max_model_len=128, num_kv_blocks=16)
    b = LLM(str(awq), dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert torch.equal(a.llm_engine.prompt_logits(ids), b.llm_engine.prompt_logits(ids))
    assert a.llm_engine.model_info()["weights"]["up_proj"] == "W4 (compressed-tensors, g32)"
    assert a.llm_engine.model_info()["weights"]["down_proj"] == "dense"


def test_conversion_is_exact_on_extreme_zeros() -> None:
    """Zero points 0 and 15 (the ends of the int4 range) survive the signed offset of compressed-tensors."""
    from lightinfer.formats.compressed_tensors import ct_to_runtime
    from lightinfer.formats.quant_config import CTScheme
    from lightinfer.kernels.reference import dequantize_w4, pack_awq, repack_awq_to_runtime

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 16), generator=gen)  # [K, N]
    zeros = torch.tensor([[0] * 8 + [15] * 8, [7] * 16])  # [K / 32, N]
    scales = torch.rand(2, 16, generator=gen).half()
    awq = {"l.qweight": pack_awq(codes), "l.qzeros": pack_awq(zeros), "l.scales": scales}
    ct, _ = awq_to_compressed_tensors(awq, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True})
    parts = {k.split(".", 1)[1]: v for k, v in ct.items()}
    scheme = CTScheme(("Linear",), 4, False, "group", 32, None)
    got = dequantize_w4(*ct_to_runtime(parts, scheme, 32, torch.float32, "l", "f")[:3])
    want = dequantize_w4(*repack_awq_to_runtime(awq["l.qweight"], awq["l.qzeros"], scales, torch.float32))
    assert torch.equal(got, want)


def test_cli_format_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_tiny_checkpoint(tmp_path / "src")
    assert cli_main(["quantize", str(src), "--out", str(tmp_path / "o"), "--method", "rtn", "--format", "awq",
                     "--quiet"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert "(awq format)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["quantize", str(src), "--out", str(tmp_path / "p"), "--format", "gguf"])
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
