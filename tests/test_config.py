"""EngineConfig: validation, the resolution step (every automatic setting decided, then frozen) and the CLI flags of
the settings that change a CPU engine's results or memory."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from lightinfer.cli.common import add_engine_args, engine_kwargs
from lightinfer.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, choose_max_model_len, cpu_auto_dtype
from lightinfer.kernels import switches


def test_resolve_decides_every_automatic_setting_and_leaves_the_original() -> None:
    cfg = EngineConfig("m", device="cpu")
    got = cfg.resolve(model_max_len=32768, quantized=True)
    assert got.resolved and not cfg.resolved
    assert got.max_model_len == DEFAULT_MAX_MODEL_LEN and cfg.max_model_len is None
    assert got.torch_dtype == cpu_auto_dtype(True, switches.current().cpu_lowbit)
    assert got.dtype == str(got.torch_dtype).replace("torch.", "") and cfg.dtype == "auto"
    assert got.device == "cpu" and got.long_prefill_token_threshold == 512
    assert (got.cpu_lowbit, got.cpu_w4) == (switches.current().cpu_lowbit, switches.current().cpu_w4)
    assert got.resolve(model_max_len=1, quantized=False) is got  # resolved once: the facts are not asked again
    dense = cfg.resolve(model_max_len=1024, quantized=False)
    assert dense.torch_dtype == torch.float32 and dense.max_model_len == 1024


def test_a_resolved_config_is_frozen_and_replace_gives_a_new_unresolved_one() -> None:
    got = EngineConfig("m", device="cpu", max_model_len=64).resolve(model_max_len=128, quantized=False)
    with pytest.raises(dataclasses.FrozenInstanceError, match="resolved and frozen.*dataclasses.replace"):
        got.max_model_len = 32
    again = dataclasses.replace(got, max_model_len=32)
    assert again.max_model_len == 32 and not again.resolved
    assert again.resolve(model_max_len=128, quantized=False) == dataclasses.replace(got, max_model_len=32)


def test_max_model_len_beyond_the_model_is_refused_with_the_limit() -> None:
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds .* \(2048.*use at most 2048"):
        EngineConfig("m", device="cpu", max_model_len=4096).resolve(model_max_len=2048, quantized=False)
    assert choose_max_model_len(100, None) == 100 and choose_max_model_len(100, 64) == 64


def test_the_cpu_settings_fields_win_over_the_switches() -> None:
    with switches.override(cpu_w4="int8", cpu_lowbit=True):
        unset = EngineConfig("m", device="cpu").resolve(model_max_len=64, quantized=True)
        set_ = EngineConfig("m", device="cpu", cpu_w4="torch", cpu_lowbit=False).resolve(model_max_len=64,
                                                                                       quantized=True)
    assert (unset.cpu_w4, unset.cpu_lowbit) == ("int8", True)
    assert (set_.cpu_w4, set_.cpu_lowbit) == ("torch", False)
    assert set_.torch_dtype == torch.float32  # the exact path: dtype auto means fp32
    assert set_.kernel_switches() == {"cpu_lowbit": False, "cpu_w4": "torch"}
    assert EngineConfig("m", device="cpu", cpu_w4="c").kernel_switches() == {"cpu_w4": "c"}


@pytest.mark.parametrize("field,value,match", [
    ("cpu_w4", "fast", "cpu_w4 must be one of c, int8, torch"),
    ("cpu_lowbit", "yes", "cpu_lowbit must be True .* False .* or None"),
    ("cpu_lowbit", 0, "cpu_lowbit must be True"),
])
def test_bad_cpu_settings_say_what_is_allowed(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig("m", device="cpu", **{field: value})


def test_every_engine_switch_is_a_config_field_and_a_cli_flag() -> None:
    """The switches whose role is ``engine`` (kernels/switches.py) are settings: a field of EngineConfig and a flag
    of every command that starts an engine."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = {a.dest for a in p._actions}
    assert switches.engine_switches() == ("cpu_lowbit", "cpu_w4")
    for name in switches.engine_switches():
        assert name in fields and name in flags, name


def test_the_cli_flags_reach_the_config() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--cpu-w4", "int8", "--no-cpu-lowbit"]))
    assert (kw["cpu_w4"], kw["cpu_lowbit"]) == ("int8", False)
    kw = engine_kwargs(p.parse_args([]))
    assert (kw["cpu_w4"], kw["cpu_lowbit"]) == (None, None)  # unset: the environment switch decides
    assert EngineConfig("m", device="cpu", **{k: v for k, v in kw.items() if k != "device"}).cpu_w4 is None
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-w4", "fast"])
