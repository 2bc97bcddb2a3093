"""The three op backends share one interface, and the layers pick (or are told) which one runs."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightinfer.kernels import BACKEND_NAMES, OP_NAMES, get_backend, switches
from lightinfer.layers import ops


def _params(fn: object) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_every_backend_has_every_op_with_one_signature() -> None:
    reference = get_backend("reference")
    for name in BACKEND_NAMES:
        backend = get_backend(name)
        for op in OP_NAMES:
            assert callable(getattr(backend, op, None)), f"{name} lacks {op}"
            assert _params(getattr(backend, op)) == _params(getattr(reference, op)), f"{name}.{op}"


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="torch_cpu"):
        get_backend("cuda")
    with pytest.raises(ValueError, match="torch_cpu"), ops.use_backend("fast"):
        pass


def test_ops_for_picks_by_device_and_can_be_forced(kernel_env) -> None:
    x = torch.zeros(2)
    kernel_env(switches.BACKEND_ENV, None)
    assert ops.ops_for(x) is get_backend("torch_cpu") and not ops.uses_triton(x)
    with ops.use_backend("reference"):
        assert ops.ops_for(x) is get_backend("reference")
        with ops.triton_on_cpu():  # the name the GPU-path-on-CPU tests use
            assert ops.backend_name(x) == "triton" and ops.uses_triton(x)
        assert ops.backend_name(x) == "reference"
    assert ops.backend_name(x) == "torch_cpu"
    kernel_env(switches.BACKEND_ENV, "reference")
    assert ops.ops_for(x) is get_backend("reference")
    with ops.use_backend("torch_cpu"):  # a block overrides the variable
        assert ops.backend_name(x) == "torch_cpu"


def test_a_forced_reference_backend_runs_the_layers(kernel_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """LIGHTINFER_BACKEND=reference: a layer's ops go through the naive twins and give torch_cpu's result."""
    from lightinfer.layers.norm import RMSNorm

    norm = RMSNorm(16, 1e-6, torch.float32)
    norm.weight.data = torch.rand(16)
    x = torch.randn(3, 16)
    fast = norm(x)
    kernel_env(switches.BACKEND_ENV, "reference")
    reference, calls = get_backend("reference"), []
    original = reference.rms_norm
    monkeypatch.setattr(reference, "rms_norm", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    slow = norm(x)
    assert calls and torch.allclose(slow, fast, atol=1e-6)
