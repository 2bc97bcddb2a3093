"""Weight forms: the run-time implementation of a linear layer's weight, one object per form.

A linear layer (``Linear``, ``W4A16Linear``, ``W8A16Linear``, the LM heads) keeps the tensors it loads under
Hugging Face's names (``weight``; ``qweight`` / ``scales`` / ``zeros``) and holds in ``weight_impl`` the
:class:`LinearWeight` that computes with them. The form is chosen once, when the weight is prepared for its
device (``pack_for_cpu`` on a CPU engine; the layer's constructor and load methods otherwise), and from then
on the layer's ``forward`` is ``self.weight_impl.forward(x, self.bias)``: no layer branches on the backend,
and the engine's byte accounting and the CPU step recorder ask the form (:meth:`LinearWeight.nbytes`,
:meth:`LinearWeight.tensors`) instead of knowing its attributes. The forms:

* :class:`LayerDenseWeight`: a dense layer's own ``weight`` through ``F.linear`` (any device).
* :class:`W4RuntimeWeight` / :class:`W8RuntimeWeight`: the layer's 4-/8-bit run-time tensors through the op
  backend (``ops_for(x)``: Triton on CUDA, the reference ops where forced); on the ``torch_cpu`` backend, a
  layer that was not prepared dequantizes once and keeps that copy.
* :class:`NativeW4Weight`: the C 4-bit product (``kernels.cpu_lowbit.CpuW4Weight``).
* :class:`TorchInt4Weight`: torch's CPU int4 GEMM (``kernels.cpu_lowbit.CpuQuantWeight``: a W4 weight, or a W8
  one as two exact int4 halves).
* :class:`Int8PerChannelWeight`: an 8-bit LM head requantized per row (``kernels.cpu_lowbit.CpuInt8Weight``).
* :class:`PackedDenseWeight`: an fp32 weight prepacked for oneDNN (``cpu_gemm.PackedWeight``).
* :class:`DequantizedWeight`: a dense copy ``[out, in]`` through ``F.linear`` (where oneDNN cannot pack it).

The CPU engine's forms of a quantized layer keep its run-time form beside them (``runtime``): where a backend
other than ``torch_cpu`` is forced on a prepared layer (the Triton path on the interpreter, the reference ops:
tests do this on a CPU engine) that form computes, from the run-time tensors the preparation kept.

A new form (a LoRA delta over any form, a tensor-parallel shard of one) is one more subclass: its ``forward``,
``nbytes`` and ``tensors``, and the layer's preparation choosing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.kernels import (
    CpuInt8Weight,
    CpuQuantWeight,
    SplitKPartials,
    cpu_int8_linear,
    cpu_quant_linear,
)
from lightinfer.kernels.cpu_lowbit import CpuW4Weight
from lightinfer.layers.cpu_gemm import PackedWeight, can_pack
from lightinfer.layers.ops import backend_name, ops_for, uses_triton


def check_runtime_tensors(layer: nn.Module) -> None:
    """Raise RuntimeError when a quantized layer's run-time tensors were released by ``pack_for_cpu``."""
    if layer.qweight is None:
        raise RuntimeError(f"{type(layer).__name__} {layer.in_features}->{layer.out_features}: its run-time tensors "
                           f"were replaced by the CPU engine's prepared weight (pack_for_cpu); the Triton path "
                           f"and dense_weight() need a layer that was not packed for the CPU")


class LinearWeight(ABC):
    """How a linear layer's weight computes ``y = x W^T + bias`` (module docstring).

    Attributes:
        cpu_prepared: the form was made for the CPU engine by ``pack_for_cpu`` (preparing again is a no-op).
        same_codes: the form holds the layer's 4-/8-bit codes in another layout, bit for bit; the others hold
            the layer's own tensors, or a copy of the weight in another precision (dequantized, or
            requantized per row), which ``engine.model_runner.dequantized_linear_bytes`` counts.
    """

    cpu_prepared: ClassVar[bool] = True
    same_codes: ClassVar[bool] = False

    @abstractmethod
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | SplitKPartials:
        """``x [..., in]`` -> ``[..., out]`` (``bias [out]`` added when given); the dtype is the form's (see
        each). Only :class:`W4RuntimeWeight` may return :class:`~lightinfer.kernels.SplitKPartials`."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this form holds beside its layer's parameters and buffers (those are the layer's: 0 for a form
        that reads only them)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor ``forward`` reads, the layer's included: what a recorded CPU step
        (``engine.cpu_graph``) must keep alive and at its address."""


class LayerDenseWeight(LinearWeight):
    """A dense layer's own ``weight [out, in]`` (read from the layer at each call: loading and ``.to()`` may
    replace the parameter) through ``F.linear``: ``y`` in ``x``'s dtype."""

    cpu_prepared = False

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.layer.weight, bias)

    def nbytes(self) -> int:
        return 0

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.layer.weight is None else [self.layer.weight]


class _RuntimeWeight(LinearWeight):
    """The 4-/8-bit run-time tensors of ``layer`` (``qweight``, ``scales``, ``zeros``, ``input_perm``, read at
    each call), run by the op backend of ``x``. On the ``torch_cpu`` backend (a layer the CPU engine did not
    prepare, e.g. built by hand) the weight is dequantized once, kept, and multiplied densely: the reference
    op would dequantize it again at every call."""

    cpu_prepared = False

    def __init__(self, layer: nn.Module) -> None:  # a W4A16Linear / W8A16Linear (they import this module)
        self.layer = layer
        self._dense: torch.Tensor | None = None  # the torch_cpu backend's dequantized copy, [out, in]

    def _dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def _dense_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._dense is None:
            self._dense = self._dense_weight()
        return F.linear(x, self._dense.to(x.dtype), bias)

    def nbytes(self) -> int:
        return 0 if self._dense is None else self._dense.nbytes

    def tensors(self) -> list[torch.Tensor]:
        held = (self.layer.qweight, self.layer.scales, self.layer.zeros, self.layer.input_perm, self._dense)
        return [t for t in held if t is not None]


class W4RuntimeWeight(_RuntimeWeight):
    """``W4A16Linear``'s run-time tensors through the backend's ``w4a16_gemm`` (``y`` in ``x``'s dtype, fp32
    accumulation). With the layer's ``defer_reduce`` and a 2-D ``x`` on the Triton path, a split K comes back
    as unreduced :class:`~lightinfer.kernels.SplitKPartials` (``layers/fusion.py``)."""

    def _dense_weight(self) -> torch.Tensor:
        return self.layer.dense_weight()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | SplitKPartials:
        if backend_name(x) == "torch_cpu":
            return self._dense_forward(x, bias)
        layer = self.layer
        check_runtime_tensors(layer)
        shape = x.shape
        if layer.input_perm is not None:  # act-order: the stored K order
            x = x.index_select(-1, layer.input_perm)
        if layer.defer_reduce and x.dim() == 2 and uses_triton(x):
            return ops_for(x).w4a16_gemm(x, layer.qweight, layer.scales, layer.zeros, bias, defer_reduce=True,
                                         integer_zeros=layer.integer_zeros)
        y = ops_for(x).w4a16_gemm(x.reshape(-1, shape[-1]), layer.qweight, layer.scales, layer.zeros, bias,
                                  integer_zeros=layer.integer_zeros)
        return y.reshape(*shape[:-1], layer.out_features)


class W8RuntimeWeight(_RuntimeWeight):
    """``W8A16Linear``'s run-time tensors through the backend's ``w8a16_gemm`` (``y`` in ``x``'s dtype, fp32
    accumulation); the ``torch_cpu`` backend's dense copy is in the layer's activation dtype."""

    def _dense_weight(self) -> torch.Tensor:
        return self.layer.dense_weight().to(self.layer.dtype)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if backend_name(x) == "torch_cpu":
            return self._dense_forward(x, bias)
        layer = self.layer
        check_runtime_tensors(layer)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)
        y = ops_for(x2).w8a16_gemm(x2.contiguous(), layer.qweight, layer.scales, layer.zeros, bias)
        return y.reshape(*shape[:-1], layer.out_features)


class _PreparedLowbit(LinearWeight):
    """A weight the CPU engine converted once (``kernels.cpu_lowbit``), held in ``prepared``; ``out_dtype``:
    the result's dtype (None: ``x``'s; fp32 for an 8-bit LM head's logits). ``runtime``: the layer's run-time
    form, which computes instead where a backend other than ``torch_cpu`` is forced on the prepared layer (a
    test running the Triton path or the reference ops on a CPU engine; it raises where the preparation released
    the run-time tensors); None: always this form."""

    def __init__(self, prepared: CpuW4Weight | CpuQuantWeight | CpuInt8Weight,
                 out_dtype: torch.dtype | None = None, runtime: LinearWeight | None = None) -> None:
        self.prepared = prepared
        self.out_dtype = out_dtype
        self.runtime = runtime
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (the layer's 16-bit bias, its fp32 copy)

    def bind_bias(self, bias: torch.Tensor | None) -> None:
        """Keep an fp32 copy of the layer's 16-bit ``bias``: the C products add an fp32 bias, and converting it
        at every call would also keep a decode step from being replayed (``cpu_graph.py``)."""
        self._bias = (bias, bias.to(torch.float32)) if bias is not None and bias.dtype != torch.float32 else None

    def nbytes(self) -> int:
        return self.prepared.nbytes + (self._bias[1].nbytes if self._bias is not None else 0)

    def tensors(self) -> list[torch.Tensor]:
        held = [t for t in vars(self.prepared).values() if isinstance(t, torch.Tensor)]
        return held + ([self._bias[1]] if self._bias is not None else [])

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.runtime is not None and backend_name(x) != "torch_cpu":
            return self.runtime.forward(x, bias)
        if self._bias is not None and bias is self._bias[0]:
            bias = self._bias[1]
        return self._product(x, self.prepared, bias, out_dtype=self.out_dtype)

    # the product of this form's prepared weight (kernels.cpu_lowbit): the 4-bit ones by default
    _product = staticmethod(cpu_quant_linear)


class NativeW4Weight(_PreparedLowbit):
    """A 4-bit weight in the C product's layout (``CpuW4Weight``, ``cpu_native.w4_linear``)."""

    same_codes = True


class TorchInt4Weight(_PreparedLowbit):
    """A 4-bit weight, or an 8-bit one as two exact 4-bit halves, for torch's CPU int4 GEMM
    (``CpuQuantWeight``)."""

    same_codes = True


class Int8PerChannelWeight(_PreparedLowbit):
    """An 8-bit weight requantized to one int8 scale per output row (``CpuInt8Weight``: an LM head's table),
    for ``cpu_native.w8_linear`` or torch's ``_weight_int8pack_mm``."""

    _product = staticmethod(cpu_int8_linear)


def lowbit_weight(prepared: CpuW4Weight | CpuQuantWeight | CpuInt8Weight | None,
                  out_dtype: torch.dtype | None = None, runtime: LinearWeight | None = None) -> LinearWeight | None:
    """The form for a weight ``kernels.cpu_lowbit``'s ``prepare_*`` returned (None where it returned None);
    ``out_dtype`` and ``runtime`` as :class:`NativeW4Weight`'s."""
    if prepared is None:
        return None
    if isinstance(prepared, CpuW4Weight):
        return NativeW4Weight(prepared, out_dtype, runtime)
    if isinstance(prepared, CpuInt8Weight):
        return Int8PerChannelWeight(prepared, out_dtype, runtime)
    return TorchInt4Weight(prepared, out_dtype, runtime)


class PackedDenseWeight(LinearWeight):
    """An fp32 weight prepacked once for oneDNN's GEMM (``cpu_gemm.PackedWeight``): fp32 ``y``. ``runtime``: as
    :class:`NativeW4Weight`'s (a quantized layer's run-time form; None for a dense layer: always this form)."""

    def __init__(self, packed: PackedWeight, runtime: LinearWeight | None = None) -> None:
        self.packed = packed
        self.runtime = runtime

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.runtime is not None and backend_name(x) != "torch_cpu":
            return self.runtime.forward(x, bias)
        return self.packed(x, bias)

    def nbytes(self) -> int:
        return self.packed.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed.packed] if isinstance(self.packed.packed, torch.Tensor) else []


class DequantizedWeight(LinearWeight):
    """A dense ``[out, in]`` copy of the weight through ``F.linear`` (cast to ``x``'s dtype): the exact CPU path
    where oneDNN cannot prepack it. ``runtime``: as :class:`NativeW4Weight`'s."""

    def __init__(self, weight: torch.Tensor, runtime: LinearWeight | None = None) -> None:
        self.weight = weight
        self.runtime = runtime

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.runtime is not None and backend_name(x) != "torch_cpu":
            return self.runtime.forward(x, bias)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def nbytes(self) -> int:
        return self.weight.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


def dense_weight_form(weight: torch.Tensor, runtime: LinearWeight | None = None) -> PackedDenseWeight | DequantizedWeight:
    """The dense form of ``weight [out, in]`` on a CPU: prepacked where oneDNN takes it (fp32), else plain;
    ``runtime`` as :class:`NativeW4Weight`'s."""
    if can_pack(weight):
        return PackedDenseWeight(PackedWeight(weight), runtime)
    return DequantizedWeight(weight, runtime)


def weight_form(module: nn.Module) -> LinearWeight | None:
    """``module``'s weight form (its ``weight_impl``), or None for a module without one."""
    form = getattr(module, "weight_impl", None)
    return form if isinstance(form, LinearWeight) else None
