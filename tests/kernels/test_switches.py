"""The kernel switches: read from the environment once, re-read on request, overridden for a block."""

from __future__ import annotations

import pytest

from lightinfer.kernels import switches


def test_defaults_and_each_variable() -> None:
    assert switches.KernelSwitches.from_env({}) == switches.KernelSwitches(None, True, True, True, None)
    env = {switches.BACKEND_ENV: "reference", switches.F16_DECODE_ENV: "0", switches.PDL_ENV: "0",
           switches.PDL_PREFETCH_ENV: "0", switches.W4A16_CONFIGS_ENV: "none"}
    assert switches.KernelSwitches.from_env(env) == switches.KernelSwitches("reference", False, False, False, "none")
    assert switches.KernelSwitches.from_env({switches.PDL_ENV: "1", switches.BACKEND_ENV: ""}).pdl


def test_a_bad_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="LIGHTINFER_BACKEND='cuda'.*triton, torch_cpu, reference"):
        switches.KernelSwitches.from_env({switches.BACKEND_ENV: "cuda"})


def test_read_once_until_reloaded(kernel_env, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_env(switches.PDL_ENV, None)
    assert switches.current().pdl
    monkeypatch.setenv(switches.PDL_ENV, "0")
    assert switches.current().pdl  # not read again at every launch
    assert not switches.reload().pdl and not switches.current().pdl


def test_override_is_scoped(kernel_env) -> None:
    kernel_env(switches.F16_DECODE_ENV, None)
    with switches.override(f16_decode=False, backend="reference") as inside:
        assert inside is switches.current() and not inside.f16_decode and inside.backend == "reference"
    assert switches.current().f16_decode and switches.current().backend is None
    with pytest.raises(ValueError, match="not one of"), switches.override(backend="fast"):
        pass
    with pytest.raises(TypeError), switches.override(colour=1):
        pass


def test_the_c_ops_target_is_a_name_or_refused() -> None:
    assert switches.KernelSwitches.from_env({}).cpu_march == "native"
    assert switches.KernelSwitches.from_env({switches.CPU_MARCH_ENV: "x86-64-v3"}).cpu_march == "x86-64-v3"
    with pytest.raises(ValueError, match="LIGHTINFER_CPU_MARCH='haswell -O0' is not a -march target"):
        switches.KernelSwitches.from_env({switches.CPU_MARCH_ENV: "haswell -O0"})  # it reaches a command line
