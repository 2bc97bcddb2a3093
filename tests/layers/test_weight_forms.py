"""Weight forms (``layers/weight_forms.py``): a linear layer computes through its ``weight_impl``, and the
engine's byte accounting and the CPU step recorder ask that object (``nbytes()``, ``tensors()``), so a form
added later (here a LoRA-style delta over any form) needs no change to the layer, the runner or the replay."""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.engine.cpu_graph import held_tensors
from lightinfer.engine.model_runner import dequantized_linear_bytes, resident_weight_bytes
from lightinfer.layers.linear import Linear, W4A16Linear
from lightinfer.layers.ops import use_backend
from lightinfer.layers.w8_linear import W8A16Linear
from lightinfer.layers.weight_forms import (
    DequantizedWeight,
    LayerDenseWeight,
    LinearWeight,
    W4RuntimeWeight,
    W8RuntimeWeight,
    weight_form,
)


class DeltaWeight(LinearWeight):
    """``W + B A`` over any base form: ``A [r, in]``, ``B [out, r]`` (a LoRA adapter's shape)."""

    def __init__(self, base: LinearWeight, a: torch.Tensor, b: torch.Tensor) -> None:
        self.base, self.a, self.b = base, a, b

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.base.forward(x, bias) + (x @ self.a.t()) @ self.b.t()

    def nbytes(self) -> int:
        return self.base.nbytes() + self.a.nbytes + self.b.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [*self.base.tensors(), self.a, self.b]


def _w4(gen: torch.Generator) -> W4A16Linear:
    layer = W4A16Linear(64, 32, True, 32, torch.float32)
    qweight = torch.randint(-2**31, 2**31 - 1, layer.qweight.shape, generator=gen, dtype=torch.int64).to(torch.int32)
    layer.load_runtime(qweight, torch.rand(layer.scales.shape, generator=gen) * 0.01,
                       torch.rand(layer.zeros.shape, generator=gen) * 15)
    layer.bias.data = torch.randn(32, generator=gen)
    return layer


def _ptrs(tensors: list[torch.Tensor]) -> set[int]:
    return {t.data_ptr() for t in tensors}


def test_a_wrapping_form_is_used_counted_and_kept_alive_without_touching_the_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _w4(gen)
    x = torch.randn(3, 64, generator=gen)
    a, b = torch.randn(4, 64, generator=gen), torch.randn(32, 4, generator=gen)
    want = layer(x) + (x @ a.t()) @ b.t()
    model = nn.Sequential(layer)
    before, _ = resident_weight_bytes(model, torch.device("cpu"))
    layer.weight_impl = DeltaWeight(layer.weight_impl, a, b)
    torch.testing.assert_close(layer(x), want)
    after, _ = resident_weight_bytes(model, torch.device("cpu"))
    assert after - before == a.nbytes + b.nbytes
    assert {a.data_ptr(), b.data_ptr(), layer.qweight.data_ptr()} <= _ptrs(held_tensors([model]))


def test_the_runtime_forms_follow_the_forced_backend_and_count_the_copy_they_make() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = _w4(gen)
    x = torch.randn(5, 64, generator=gen)
    want = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    assert type(layer.weight_impl) is W4RuntimeWeight and layer.weight_impl.nbytes() == 0
    with use_backend("reference"):  # the op over the 4-bit tensors: no copy
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert layer.weight_impl.nbytes() == 0 and dequantized_linear_bytes(nn.Sequential(layer)) == 0
    with use_backend("torch_cpu"):  # unprepared on the CPU backend: dequantized once, and that copy is counted
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert layer.weight_impl.nbytes() == 64 * 32 * 4 == dequantized_linear_bytes(nn.Sequential(layer))
    assert _ptrs([layer.qweight, layer.scales, layer.zeros]) <= _ptrs(layer.weight_impl.tensors())
    layer.load_runtime(layer.qweight.clone(), layer.scales.clone(), layer.zeros.clone())  # new tensors: a fresh form
    assert type(layer.weight_impl) is W4RuntimeWeight and layer.weight_impl.nbytes() == 0


def test_every_linear_names_its_form_and_an_exact_cpu_preparation_is_a_dense_copy() -> None:
    gen = torch.Generator().manual_seed(2)
    dense = Linear(64, 32, False, torch.float32)
    assert type(weight_form(dense)) is LayerDenseWeight and weight_form(dense).tensors() == [dense.weight]
    w8 = W8A16Linear(64, 32, False, 32, torch.float32)
    w8.load_runtime(torch.randint(-128, 128, (32, 64), generator=gen).to(torch.int8), torch.rand(2, 32) * 0.01, None)
    assert type(weight_form(w8)) is W8RuntimeWeight
    x = torch.randn(2, 64, generator=gen)
    want = torch.nn.functional.linear(x, w8.dense_weight())
    w8.pack_for_cpu()  # fp32 activations: the exact path, dequantized once beside the int8 codes
    form = weight_form(w8)
    assert form.cpu_prepared and not form.same_codes and w8.qweight is not None
    assert form.nbytes() == 64 * 32 * 4 == dequantized_linear_bytes(nn.Sequential(w8))
    torch.testing.assert_close(w8(x), want, rtol=1e-4, atol=1e-4)
    w8.pack_for_cpu()  # prepared once: a second call (a tied table is reached twice) keeps the same form
    assert weight_form(w8) is form
    assert weight_form(nn.ReLU()) is None
    assert isinstance(DequantizedWeight(torch.zeros(2, 2)), LinearWeight)


def test_a_prepared_layer_follows_a_forced_backend_through_its_runtime_form() -> None:
    """The Triton path on the interpreter and the reference ops are forced on a CPU engine whose layers were
    prepared: the exact path keeps the run-time tensors, and the forced backend's op computes from them."""
    gen = torch.Generator().manual_seed(3)
    layer = _w4(gen)
    x = torch.randn(4, 64, generator=gen)
    want = torch.nn.functional.linear(x, layer.dense_weight(), layer.bias)
    layer.pack_for_cpu()  # fp32: dequantized beside the codes
    form = weight_form(layer)
    assert form.cpu_prepared and layer.qweight is not None
    calls: list[str] = []
    runtime_forward = form.runtime.forward
    form.runtime.forward = lambda x, bias: calls.append("runtime") or runtime_forward(x, bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert calls == []  # the torch_cpu backend: the prepared form
    with use_backend("reference"):
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert calls == ["runtime"]
