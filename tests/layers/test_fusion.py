"""The fusion pass (layers/fusion.py) on small hand-built modules: what it fuses, where it defers
split-K reductions, and the errors a wrong plan gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightinfer.kernels import SplitKPartials
from lightinfer.layers.activation import SiluAndMul
from lightinfer.layers.fusion import RESIDUAL, Feeds, Fuse, FusionPlan, fuse_model, materialize
from lightinfer.layers.linear import Linear, W4A16Linear
from lightinfer.layers.norm import RMSNorm


def _w4(k: int, n: int, gen: torch.Generator) -> W4A16Linear:
    layer = W4A16Linear(k, n, False, 32, torch.float32)
    layer.qweight.copy_(torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int64)
                        .to(torch.int32))
    layer.scales.copy_(torch.rand(layer.scales.shape, generator=gen) * 0.01)
    layer.zeros.fill_(8.0)
    return layer


def _dense(k: int, n: int, gen: torch.Generator) -> Linear:
    layer = Linear(k, n, False, torch.float32)
    layer.weight.copy_(torch.randn(n, k, generator=gen))
    return layer


class _MLP(nn.Module):
    fusion_plan = FusionPlan(fuse=(Fuse("gate_up_proj", ("gate_proj", "up_proj")),),
                             feeds=(Feeds("gate_up_proj", "act_fn"), Feeds("down_proj", RESIDUAL)))

    def __init__(self, make: object, gen: torch.Generator) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = make(64, 32, gen), make(64, 32, gen), make(32, 64, gen)
        self.act_fn = SiluAndMul()
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = (self.gate_up_proj(x) if self.gate_up_proj is not None
                   else torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1))
        return materialize(self.down_proj(self.act_fn(gate_up)))


class _Block(nn.Module):
    fusion_plan = FusionPlan(feeds=(Feeds("mlp.down_proj", "norm"),))

    def __init__(self, make: object, gen: torch.Generator) -> None:
        super().__init__()
        self.mlp, self.norm = _MLP(make, gen), RMSNorm(64)


@torch.no_grad()
def test_w4_mlp_is_fused_deferred_and_computes_the_same() -> None:
    gen = torch.Generator().manual_seed(0)
    mlp = _MLP(_w4, gen)
    x = torch.randn(5, 64, generator=gen)
    before = mlp(x)
    report = fuse_model(mlp)
    assert report.fused == ["gate_up_proj"]
    assert report.deferred == ["gate_up_proj", "down_proj"]
    assert mlp.gate_proj is None and mlp.up_proj is None
    assert mlp.gate_up_proj.defer_reduce and mlp.down_proj.defer_reduce
    torch.testing.assert_close(mlp(x), before, atol=1e-5, rtol=1e-5)
    # Idempotent: a second pass finds nothing left to fuse and defers the same producers again.
    again = fuse_model(mlp)
    assert again.fused == [] and again.deferred == report.deferred


def test_dense_layers_are_fused_but_never_deferred() -> None:
    mlp = _MLP(_dense, torch.Generator().manual_seed(0))
    report = fuse_model(mlp)
    assert report.fused == ["gate_up_proj"] and report.deferred == []
    assert not hasattr(mlp.down_proj, "defer_reduce")


def test_parts_that_cannot_share_a_gemm_stay_apart() -> None:
    gen = torch.Generator().manual_seed(0)
    mlp = _MLP(_w4, gen)
    mlp.up_proj = _dense(64, 32, gen)  # e.g. a modules_to_not_convert entry
    report = fuse_model(mlp)
    assert report.fused == [] and report.deferred == ["down_proj"]
    assert mlp.gate_up_proj is None and not mlp.gate_proj.defer_reduce


def test_nested_plans_use_full_paths() -> None:
    block = _Block(_w4, torch.Generator().manual_seed(0))
    report = fuse_model(block)
    assert report.fused == ["mlp.gate_up_proj"]
    assert sorted(report.deferred) == ["mlp.down_proj", "mlp.down_proj", "mlp.gate_up_proj"]


def test_a_consumer_that_does_not_take_partials_is_a_clear_error() -> None:
    class Bad(_MLP):
        fusion_plan = FusionPlan(feeds=(Feeds("gate_proj", "down_proj"),))

    with pytest.raises(TypeError, match=r"Bad.fusion_plan: 'gate_proj' feeds 'down_proj', but W4A16Linear does not"):
        fuse_model(Bad(_w4, torch.Generator().manual_seed(0)))


def test_a_misspelt_plan_entry_is_a_clear_error() -> None:
    class Typo(_MLP):
        fusion_plan = FusionPlan(fuse=(Fuse("gate_up_proj", ("gate_proj", "upp_proj")),))

    with pytest.raises(AttributeError, match=r"Typo.fusion_plan names 'upp_proj', but Typo has no 'upp_proj'"):
        fuse_model(Typo(_w4, torch.Generator().manual_seed(0)))


def test_partials_into_a_norm_without_residual_is_a_clear_error() -> None:
    parts = SplitKPartials(torch.randn(2, 3, 64), None, torch.float32)
    with pytest.raises(TypeError, match="only the residual form"):
        RMSNorm(64)(parts)


def test_materialize_sums_partials_and_passes_tensors_through() -> None:
    p = torch.randn(3, 2, 8)
    bias = torch.randn(8)
    torch.testing.assert_close(materialize(SplitKPartials(p, bias, torch.float32)), p.sum(0) + bias)
    t = torch.randn(2, 8)
    assert materialize(t) is t
