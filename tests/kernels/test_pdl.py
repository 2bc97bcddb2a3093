"""Programmatic dependent launch: when it is on (the SASS check that every kernel waits before it touches
memory is ``tests/kernels/audit/test_pdl_check.py``)."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import pdl, switches


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, kernel_env):
    """A pretend CUDA device of a chosen compute capability, outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel_env(switches.PDL_ENV, None)
    kernel_env(switches.PDL_PREFETCH_ENV, None)

    def set_capability(cap: tuple[int, int], driver: int | None = 13000) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(pdl, "driver_version", lambda: driver)
        pdl._supported.cache_clear()
        return torch.device("cuda", 0)

    yield set_capability
    pdl._supported.cache_clear()


@pytest.mark.parametrize("cap,on", [((9, 0), True), ((10, 0), True), ((12, 0), True), ((8, 9), False), ((8, 6), False)])
def test_pdl_is_on_from_hopper(gpu, cap: tuple[int, int], on: bool) -> None:
    device = gpu(cap)
    assert pdl.pdl_enabled(device) is on
    assert pdl.pdl_launch(device) == ({"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False})


@pytest.mark.parametrize("driver,on", [(12030, True), (12020, False), (None, False)])
def test_pdl_needs_a_driver_that_captures_it_in_graphs(gpu, driver: int | None, on: bool) -> None:
    assert pdl.pdl_enabled(gpu((9, 0), driver)) is on


def test_prefetch_follows_pdl_and_its_own_switch(gpu, kernel_env) -> None:
    device = gpu((9, 0))
    assert pdl.prefetch_enabled(device)
    kernel_env(switches.PDL_PREFETCH_ENV, "0")
    assert not pdl.prefetch_enabled(device) and pdl.pdl_enabled(device)
    kernel_env(switches.PDL_PREFETCH_ENV, "1")
    kernel_env(switches.PDL_ENV, "0")
    assert not pdl.prefetch_enabled(device)


def test_driver_version_is_none_or_plausible() -> None:
    version = pdl.driver_version()  # None on this CPU machine (no libcuda); a real number on a GPU machine
    assert version is None or 9000 <= version < 100000


def test_pdl_off_on_cpu_interpreter_and_by_request(gpu, monkeypatch: pytest.MonkeyPatch, kernel_env) -> None:
    device = gpu((9, 0))
    assert pdl.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    kernel_env(switches.PDL_ENV, "0")
    assert not pdl.pdl_enabled(device)
    kernel_env(switches.PDL_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(device)
