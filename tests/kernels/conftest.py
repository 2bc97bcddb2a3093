"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton decides at decoration time (``@triton.jit``, i.e. when a kernel module is imported)
whether kernels are interpreted, so the variable must be set before anything imports triton;
the Makefile sets it for the whole run, this covers ``pytest tests/kernels`` run by hand.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch):
    """``set(name, value)``: set (None: unset) a ``LIGHTINFER_*`` kernel switch's environment variable and
    re-read the switches (``kernels/switches.py`` reads them once); all restored afterwards."""
    from lightinfer.kernels import switches

    def set_var(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        switches.reload()

    yield set_var
    monkeypatch.undo()
    switches.reload()
