"""The direct Python entry points of the C ops (``kernels/native_pycall.py``): the same results as the ctypes
functions, clear errors for wrong arguments, and the ctypes fallback where the Python headers are missing."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from lightinfer.kernels import cpu_native, native_pycall

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")
needs_headers = pytest.mark.skipif(native_pycall.python_include() is None, reason="no Python headers here")


def _ctypes_fn(name: str) -> ctypes._CFuncPtr:
    ops = cpu_native.library()
    assert ops is not None
    fn = getattr(ctypes.CDLL(str(ops.path)), name)
    fn.argtypes, fn.restype = cpu_native._SIGNATURES[name], None
    return fn


@needs_native
@needs_headers
def test_the_direct_entry_points_serve_where_the_headers_are() -> None:
    ops = cpu_native.library()
    assert ops is not None and ops.direct
    assert type(ops.li_silu_mul).__name__ == "builtin_function_or_method"


@needs_native
@needs_headers
def test_a_direct_call_computes_what_the_ctypes_call_does() -> None:
    """The 4-bit product (13 arguments: pointers, ints, None for a NULL bias) and SiLU·mul through both."""
    ops = cpu_native.library()
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 256), generator=gen, dtype=torch.uint8)
    packed = cpu_native.w4_pack(codes)
    dm = torch.rand(32, 2, 8, generator=gen).half()
    x = torch.randn(3, 256, generator=gen)
    work = torch.empty(4096)
    outs = []
    for fn in (ops.li_w4a16_linear, _ctypes_fn("li_w4a16_linear")):
        y = torch.empty(3, 32)
        fn(x.data_ptr(), 0, 3, 256, packed.data_ptr(), dm.data_ptr(), 32, 32, None, y.data_ptr(), 0,
           work.data_ptr(), 1)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    h = torch.randn(4, 64, generator=gen)
    a, b = torch.empty(4, 32), torch.empty(4, 32)
    ops.li_silu_mul(h.data_ptr(), a.data_ptr(), 4, 32, 0, 1)
    _ctypes_fn("li_silu_mul")(h.data_ptr(), b.data_ptr(), 4, 32, 0, 1)
    assert torch.equal(a, b)


@needs_native
@needs_headers
def test_wrong_arguments_are_a_python_error_not_a_crash() -> None:
    ops = cpu_native.library()
    with pytest.raises(TypeError, match="expected 6 arguments, got 2"):
        ops.li_silu_mul(0, 0)
    with pytest.raises(TypeError):
        ops.li_silu_mul("not a pointer", 0, 1, 1, 0, 1)
    with pytest.raises(OverflowError, match="argument 2 does not fit a C int"):
        ops.li_silu_mul(0, 0, 1 << 40, 1, 0, 1)


def test_an_argument_type_without_a_direct_call_is_refused() -> None:
    with pytest.raises(ValueError, match="li_odd: no direct call for the argument type"):
        native_pycall.source({"li_odd": (ctypes.c_double,)})


@needs_native
def test_without_python_headers_the_ctypes_functions_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "status", "not loaded")
    monkeypatch.setattr(native_pycall, "python_include", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a build of its own
    ops = cpu_native.library()
    assert ops is not None and not ops.direct and isinstance(ops.li_silu_mul, ctypes._CFuncPtr)
    assert native_pycall.load(ops.path) is None  # no module inside
    x = torch.randn(2, 16)
    assert torch.allclose(cpu_native.silu_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:], atol=1e-6)
    assert ops.replay is None  # packed calls need the module: the recorded steps loop over the ops instead


@needs_native
@needs_headers
def test_packed_calls_replay_in_order() -> None:
    """Two dependent calls (RMSNorm of x, then SiLU·mul of its output) packed and made by one li_replay: the
    results of the direct calls, floats (eps) and NULL pointers included."""
    ops = cpu_native.library()
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    outs = [(torch.empty(3, 64), torch.empty(3, 32)) for _ in range(2)]  # (normed, gated): direct, packed
    calls = [[("li_add_rms_norm", (None, x.data_ptr(), None, w.data_ptr(), 0, normed.data_ptr(), 3, 64, 1e-5, 0, 1)),
              ("li_silu_mul", (normed.data_ptr(), gated.data_ptr(), 3, 32, 0, 1))] for normed, gated in outs]
    for name, args in calls[0]:
        getattr(ops, name)(*args)
    buf = cpu_native.pack_calls(calls[1])
    assert buf.numel() == 2 * 8 * (1 + native_pycall.max_args(cpu_native._SIGNATURES))
    ops.replay(buf.data_ptr(), 2)
    assert torch.equal(outs[0][1], outs[1][1]) and outs[0][1].abs().sum() > 0


@needs_native
@needs_headers
def test_bad_packed_calls_are_python_errors() -> None:
    ops = cpu_native.library()
    with pytest.raises(ValueError, match="li_silu_mul takes 6 arguments, got 2"):
        cpu_native.pack_calls([("li_silu_mul", (0, 0))])
    with pytest.raises(KeyError):
        cpu_native.pack_calls([("li_nothing", ())])
    bad = cpu_native.pack_calls([("li_silu_mul", (0, 0, 0, 0, 0, 1))])
    bad[:8] = torch.tensor([99], dtype=torch.int64).view(torch.uint8)  # no op 99
    with pytest.raises(ValueError, match="li_replay: no op 99"):
        ops.replay(bad.data_ptr(), 1)
