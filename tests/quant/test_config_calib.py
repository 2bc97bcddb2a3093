"""QuantConfig validation and group-size choice; the offline calibration / evaluation text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightinfer.quant.calib import builtin_split, calibration_samples, read_text_file
from lightinfer.quant.config import QuantConfig
from tests.conftest import requires_smollm2

SMOL_LAYERS = {"q_proj": 576, "k_proj": 576, "v_proj": 576, "o_proj": 576, "gate_proj": 576, "up_proj": 576,
               "down_proj": 1536}


@pytest.mark.parametrize("kwargs,msg", [
    ({"group_size": 96}, "group_size 96 is not supported"),
    ({"group_size": "big"}, "'auto' or one of"),
    ({"w_bit": 3}, "w_bit 3 is not supported"),
    ({"zero_point": False}, "zero_point must be True"),
    ({"method": "gptq"}, "method must be one of"),
    ({"num_samples": 0}, "num_samples"),
    ({"seq_len": 4}, "seq_len"),
    ({"max_shrink": 1.0}, "max_shrink"),
])
def test_invalid_settings(kwargs: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        QuantConfig(**kwargs)


def test_group_size_choice() -> None:
    g, why = QuantConfig().resolve_group_size(SMOL_LAYERS)
    assert g == 64 and "128 does not divide in_features [576]" in why
    assert QuantConfig(group_size="32").resolve_group_size(SMOL_LAYERS)[0] == 32
    assert QuantConfig().resolve_group_size({"a": 4096, "b": 11008})[0] == 128
    with pytest.raises(ValueError, match=r"in_features=576 of layer 'q_proj'.*would work: 64, 32"):
        QuantConfig(group_size=128).resolve_group_size(SMOL_LAYERS)
    with pytest.raises(ValueError, match="no supported group size"):
        QuantConfig().resolve_group_size({"x": 100})


def test_hf_dict_is_autoawq_gemm() -> None:
    d = QuantConfig().to_hf_dict(64)
    assert d == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["lm_head"]}


def test_builtin_split_deterministic_disjoint_prose() -> None:
    calib, held_out = builtin_split()
    assert (calib, held_out) == builtin_split()
    assert len(calib) > 80_000 and len(held_out) > 80_000
    cal_pars, eval_pars = set(calib.split("\n\n")), set(held_out.split("\n\n"))
    assert not cal_pars & eval_pars
    assert "::=" not in held_out and ">>>" not in held_out


@requires_smollm2
def test_held_out_text_is_long_enough() -> None:
    from transformers import AutoTokenizer

    from lightinfer.loader import resolve_model_path

    gguf = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _, held_out = builtin_split()
    assert len(tok(held_out, add_special_tokens=False)["input_ids"]) >= 20_000
    samples = calibration_samples(tok, None, 16, 512)
    assert len(samples) == 16 and all(len(s) == 512 for s in samples)


def test_text_files(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert read_text_file(p) == "one\n\ntwo"
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not valid JSON"):
        read_text_file(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        read_text_file(tmp_path / "missing.txt")
