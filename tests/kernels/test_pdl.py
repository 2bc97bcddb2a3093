"""Programmatic dependent launch: when it is on, and that every kernel waits before it touches memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lightinfer.kernels import pdl


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """A pretend CUDA device of a chosen compute capability, outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(pdl.ENV_VAR, raising=False)

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


def test_prefetch_follows_pdl_and_its_own_switch(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    device = gpu((9, 0))
    assert pdl.prefetch_enabled(device)
    monkeypatch.setenv(pdl.PREFETCH_ENV_VAR, "0")
    assert not pdl.prefetch_enabled(device) and pdl.pdl_enabled(device)
    monkeypatch.setenv(pdl.PREFETCH_ENV_VAR, "1")
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.prefetch_enabled(device)


def test_driver_version_is_none_or_plausible() -> None:
    version = pdl.driver_version()  # None on this CPU machine (no libcuda); a real number on a GPU machine
    assert version is None or 9000 <= version < 100000


def test_pdl_off_on_cpu_interpreter_and_by_request(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    device = gpu((9, 0))
    assert pdl.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    assert not pdl.pdl_enabled(device)
    monkeypatch.setenv(pdl.ENV_VAR, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(device)


def test_every_kernel_waits_before_touching_memory() -> None:
    """Compiled for sm_90 with PDL on, each kernel's SASS waits (ACQBULK) before its first global load or
    store and releases the next kernel (PREEXIT): nothing can read a buffer the previous kernel is still
    writing, or overwrite one it is still reading. The W4 GEMMs' L2 prefetches of weights come before it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "lightinfer.kernels.pdl", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} >= {"w4a16_gemv", "w4a16_tiled", "w4a16_swap_ab", "w4a16_split_k_reduce",
                                           "w4_dequant", "attn_decode", "attn_decode_reduce", "attn_prefill",
                                           "store_kv", "rms_norm", "rotary_qk", "silu_and_mul", "rope_store"}
    assert [r for r in rows if not (r["waits"] and r["releases"] and r["wait_before_memory"])] == []
    # Only the W4 GEMMs prefetch (their weight slices, into L2) before the wait.
    assert {r["kernel"] for r in rows if r["prefetches_before_wait"]} == {"w4a16_gemv", "w4a16_tiled", "w4a16_swap_ab"}
    assert proc.returncode == 0, proc.stderr[-3000:]
