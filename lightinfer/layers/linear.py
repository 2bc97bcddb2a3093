"""Linear layers: dense (``Linear``) and 4-bit weight, 16-bit activation (``W4A16Linear``); the 8-bit
sibling is ``w8_linear.W8A16Linear``.

Dense layers keep Hugging Face parameter names (``weight``/``bias``) so checkpoints load by name; the
quantized ones take their tensors from ``lightinfer.loader`` (AWQ, GPTQ, compressed-tensors, GGUF
converted into the run-time layout once, at load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lightinfer.kernels import (
    SplitKPartials,
    dequantize_w4,
    prepare_w4_cpu,
    repack_awq_to_runtime,
    zeros_are_integers,
)
from lightinfer.kernels.cpu_lowbit import lowbit_takes
from lightinfer.layers.cpu_gemm import PackedWeight, can_pack, use_cpu_lowbit
from lightinfer.layers.w8_linear import W8A16Linear, inverse_permutation
from lightinfer.layers.weight_forms import (
    LayerDenseWeight,
    LinearWeight,
    PackedDenseWeight,
    W4RuntimeWeight,
    check_runtime_tensors,
    dense_weight_form,
    lowbit_weight,
)

if TYPE_CHECKING:
    from lightinfer.formats.scheme import LinearFormat


class Linear(nn.Module):
    """Dense ``y = x W^T + b`` with ``weight [out, in]`` (``nn.Linear`` orientation)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        # the weight's form (layers/weight_forms.py): the parameter itself, or its oneDNN prepacked copy on a CPU
        self.weight_impl: LinearWeight = LayerDenseWeight(self)

    def pack_for_cpu(self) -> None:
        """Reorder an fp32 CPU weight once for the prepacked GEMM (``cpu_gemm``, a ``PackedDenseWeight``
        form); the plain ``weight`` is released (``None``) so memory does not double. No-op elsewhere."""
        if self.weight is not None and can_pack(self.weight):
            self.weight_impl = PackedDenseWeight(PackedWeight(self.weight))
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        return self.weight_impl.forward(x, self.bias)


class W4A16Linear(nn.Module):
    """W4A16 linear layer: 4-bit group-quantized weight, activations in 16 (or 32) bits.

    Buffers hold the run-time layout of ``kernels/reference.py``: ``qweight`` int32
    ``[out, in // 8]``, ``scales`` and ``zeros`` ``[in // group_size, out]`` in the activation
    dtype. :meth:`load_awq` converts AutoAWQ's "gemm" disk tensors once at load time;
    :meth:`load_runtime` takes tensors ``lightinfer.formats`` already converted (GPTQ,
    compressed-tensors, GGUF). ``input_perm`` (None, or int64 ``[in]``): act-order checkpoints store
    K reordered so that groups are contiguous; the GPU path gathers ``x[..., input_perm]`` once per
    call, the CPU path un-permutes its dense copy instead. ``integer_zeros``: every stored zero point is an
    integer (AWQ, GPTQ, compressed-tensors, GGUF Q4_0; not GGUF Q4_1 / Q4_K), worked out by the load
    methods and passed to the GEMM, which then takes its cheaper decode; False (exact for any zero point)
    until a load method has looked.

    Raises:
        ValueError: ``in_features`` not a multiple of ``group_size`` or ``out_features`` not a
            multiple of 8 (the packing unit).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if in_features % group_size or in_features % 8:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        if out_features % 8:
            raise ValueError(f"out_features {out_features} is not a multiple of 8 (4-bit packing unit)")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        num_groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(num_groups, out_features, dtype=dtype))
        self.register_buffer("zeros", torch.zeros(num_groups, out_features, dtype=dtype))
        self.register_buffer("input_perm", None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        # On the Triton path, return a split K unreduced (SplitKPartials) for the next op to sum as it
        # loads it: set by the fusion pass (layers/fusion.py) where the model declares that op takes partials.
        self.defer_reduce = False
        self.integer_zeros = False  # set by load_awq / load_runtime (and the dummy weights) once the zeros are known
        # the weight's form (layers/weight_forms.py): the run-time tensors through the op backend, until
        # pack_for_cpu picks the CPU engine's form (low-bit for the C / int4 GEMM, or dequantized)
        self.weight_impl: LinearWeight = W4RuntimeWeight(self)
        self.rows_read = False  # an embedding reads rows of this table: pack_for_cpu keeps the run-time tensors

    @torch.no_grad()
    def load_awq(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
        """Load AutoAWQ "gemm" tensors: qweight int32 ``[in, out // 8]``, qzeros int32
        ``[in // G, out // 8]``, scales fp16 ``[in // G, out]``.

        Raises:
            ValueError: shapes that do not match this layer.
        """
        want = (self.in_features, self.out_features // 8)
        if tuple(qweight.shape) != want or tuple(scales.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"AWQ tensors qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} do not match a "
                f"{self.in_features}->{self.out_features} layer with group_size {self.group_size} "
                f"(expected qweight {want}, scales {tuple(self.scales.shape)})"
            )
        qw, s, z = repack_awq_to_runtime(qweight.to(torch.int32), qzeros.to(torch.int32), scales, self.scales.dtype)
        self.qweight.copy_(qw)
        self.scales.copy_(s)
        self.zeros.copy_(z)
        self.integer_zeros = True  # AWQ zero points are 4-bit codes
        self.weight_impl = W4RuntimeWeight(self)  # new tensors: any prepared form is stale

    @torch.no_grad()
    def load_runtime(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     input_perm: torch.Tensor | None = None) -> None:
        """Take tensors already in the run-time layout: qweight int32 ``[out, in // 8]``, scales and
        zeros float ``[in // G, out]`` (cast to this layer's dtype), ``input_perm`` int ``[in]`` or None.
        Sets ``integer_zeros`` from the zeros as stored (in this layer's dtype).

        Raises:
            ValueError: shapes that do not match this layer.
        """
        if (tuple(qweight.shape) != tuple(self.qweight.shape) or tuple(scales.shape) != tuple(self.scales.shape)
                or tuple(zeros.shape) != tuple(self.zeros.shape)):
            raise ValueError(
                f"W4 tensors qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} / zeros "
                f"{tuple(zeros.shape)} do not match a {self.in_features}->{self.out_features} layer with "
                f"group_size {self.group_size} (expected {tuple(self.qweight.shape)}, {tuple(self.scales.shape)})")
        self.qweight.copy_(qweight)
        self.scales.copy_(scales)
        self.zeros.copy_(zeros)
        self.integer_zeros = zeros_are_integers(self.zeros)
        self.input_perm = None if input_perm is None else input_perm.to(self.qweight.device, torch.int64)
        self.weight_impl = W4RuntimeWeight(self)  # new tensors: any prepared form is stale

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` in the original input order, in the scales' dtype.

        Raises:
            RuntimeError: the run-time tensors were released for the CPU engine (:meth:`pack_for_cpu`).
        """
        check_runtime_tensors(self)
        w = dequantize_w4(self.qweight, self.scales, self.zeros)
        if self.input_perm is not None:
            w = w.index_select(1, inverse_permutation(self.input_perm))
        return w

    def pack_for_cpu(self) -> None:
        """Prepare the weight once for the CPU GEMM, choosing its form (``layers/weight_forms.py``); no-op on
        CUDA. With 16-bit activations (and the ``cpu_lowbit`` switch on) it stays 4-bit
        (``kernels.prepare_w4_cpu``: the C product's layout, ``NativeW4Weight``, or torch's int4 GEMM layout,
        ``TorchInt4Weight``); otherwise (fp32 activations: the exact path, or a shape those kernels cannot take)
        it is dequantized once and prepacked for the fp32 GEMM (``cpu_gemm``; ``PackedDenseWeight``, or
        ``DequantizedWeight`` where oneDNN cannot pack it). A low-bit form replaces the run-time tensors
        (``qweight`` etc. become None: the same codes are not held twice) unless ``rows_read`` (an embedding
        reads rows of this table); the exact path keeps them beside its dense copy."""
        if self.qweight is None or self.qweight.is_cuda or self.weight_impl.cpu_prepared:
            return  # (a tied table is reached twice: as the embedding's and as the LM head's)
        form, runtime = None, W4RuntimeWeight(self)  # runtime: where another backend is forced (weight_forms)
        if use_cpu_lowbit(self.scales.dtype):
            form = lowbit_weight(prepare_w4_cpu(self.qweight, self.scales, self.zeros, self.input_perm), None, runtime)
        if form is None:
            self.weight_impl = dense_weight_form(self.dense_weight(), runtime)
            return
        form.bind_bias(self.bias)
        self.weight_impl = form
        if not self.rows_read:  # the same codes in another layout: one copy
            self.qweight = self.scales = self.zeros = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """``x [..., in]`` -> ``[..., out]`` (fp32 accumulation), by the weight's form (``weight_impl``).

        On a CPU engine, the form :meth:`pack_for_cpu` chose (4-bit for the C product or torch's int4 GEMM, or
        the exact dequantized fallback; a backend other than ``torch_cpu`` forced on it runs the run-time
        tensors, where they were kept). Otherwise the run-time tensors through the op backend
        (``W4RuntimeWeight``): on the ``triton`` and ``reference`` backends the op reads the 4-bit tensors every
        call (on CUDA that is the point: 4x fewer bytes), and with ``defer_reduce`` and a 2-D ``x`` on the Triton
        path a split K comes back as unreduced :class:`SplitKPartials`; on ``torch_cpu`` a layer used unprepared
        dequantizes once and keeps that.
        """
        return self.weight_impl.forward(x, self.bias)


def fuse_linears(layers: list[Linear | W4A16Linear]) -> Linear | W4A16Linear | None:
    """One layer computing ``cat([l(x) for l in layers], -1)`` with a single GEMM (q/k/v, gate/up).

    Dense weights ``[out_i, in]`` and AWQ run-time tensors (``qweight [out_i, in // 8]``,
    ``scales``/``zeros`` ``[in // G, out_i]``) concatenate along the output dimension, so the
    fused layer's output is exactly the concatenation of the parts' outputs. One launch instead
    of two or three, and no ``torch.cat`` of the activations afterwards. A fused 4-bit layer has
    ``integer_zeros`` only if every part has (a GGUF file may mix Q4_0 and Q4_K projections).

    Returns:
        The fused layer, or None when the parts cannot share one GEMM (a mix of dense and 4-bit
        layers, e.g. a ``modules_to_not_convert`` entry, different group sizes or inputs).
    """
    first = layers[0]
    if any(not isinstance(m, (Linear, W4A16Linear)) for m in layers):
        return None  # W8A16Linear parts run apart
    perms = [getattr(m, "input_perm", None) for m in layers]
    if any(p is not None for p in perms) and not all(p is not None and torch.equal(p, perms[0]) for p in perms):
        return None  # act-order parts share one GEMM only with one input order
    kinds = {(type(m), m.in_features, getattr(m, "group_size", None), m.bias is not None,
              m.scales.dtype if isinstance(m, W4A16Linear) else m.weight.dtype) for m in layers}
    if len(kinds) != 1:
        return None
    out_features = sum(m.out_features for m in layers)
    has_bias = first.bias is not None
    with torch.device("meta"):  # the constructor's placeholders allocate nothing; real tensors follow
        if isinstance(first, W4A16Linear):
            fused: Linear | W4A16Linear = W4A16Linear(first.in_features, out_features, has_bias, first.group_size,
                                                      first.scales.dtype)
        else:
            fused = Linear(first.in_features, out_features, has_bias, first.weight.dtype)
    with torch.no_grad():
        if isinstance(fused, W4A16Linear):
            fused.qweight = torch.cat([m.qweight for m in layers])
            fused.scales = torch.cat([m.scales for m in layers], dim=1)
            fused.zeros = torch.cat([m.zeros for m in layers], dim=1)
            fused.input_perm = perms[0]
            fused.integer_zeros = all(m.integer_zeros for m in layers)  # one fractional part: the exact decode
        else:
            fused.weight = nn.Parameter(torch.cat([m.weight for m in layers]), requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
    return fused


def make_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    quant_config: dict | None,
    prefix: str,
) -> Linear | W4A16Linear | W8A16Linear:
    """The layer for ``prefix`` as ``quant_config`` (a checkpoint's ``quantization_config``, with the
    per-module map a :class:`~lightinfer.loader.Checkpoint` adds) stores it: ``W4A16Linear``,
    ``W8A16Linear`` or a dense ``Linear`` (``lightinfer.formats.scheme.linear_format``)."""
    from lightinfer.formats.scheme import linear_format

    fmt = linear_format(quant_config, prefix)
    if fmt.kind == "w4":
        return W4A16Linear(in_features, out_features, bias, fmt.runtime_group_size(in_features), dtype)
    if fmt.kind == "w8":
        return W8A16Linear(in_features, out_features, bias, fmt.runtime_group_size(in_features), dtype,
                           symmetric=fmt.symmetric)
    return Linear(in_features, out_features, bias, dtype)


def linear_nbytes(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant_config: dict | None, prefix: str,
) -> tuple[int, int]:
    """Bytes of the layer :func:`make_linear` would build for ``prefix``, by arithmetic (nothing is built).

    Returns:
        ``(stored, cpu_dense)``: the layer's parameters and buffers; and for a W4/W8 layer the dense copy of
        its weight that a CPU engine keeps for the fp32 GEMM (``pack_for_cpu``), else 0 (also 0 where the layer
        stays low-bit on a CPU, ``use_cpu_lowbit(dtype)`` and a shape the int4 GEMM takes: its prepared form
        replaces the run-time tensors).
    """
    from lightinfer.formats.scheme import linear_format

    elem = torch.empty(0, dtype=dtype).element_size()
    bias_bytes = out_features * elem if bias else 0
    fmt = linear_format(quant_config, prefix)
    if fmt.kind == "dense":
        return in_features * out_features * elem + bias_bytes, 0
    groups = in_features // max(fmt.runtime_group_size(in_features), 1)
    if fmt.kind == "w4":  # int32 codes [N, K/8]; scales and zeros [K/G, N] in the activation dtype
        stored = out_features * in_features // 2 + 2 * groups * out_features * elem
    else:  # int8 codes [N, K]; fp32 scales (and zeros unless symmetric) [K/G, N]
        stored = out_features * in_features + (1 if fmt.symmetric else 2) * groups * out_features * 4
    lowbit = stays_lowbit_on_cpu(fmt, out_features, in_features, dtype)
    return stored + bias_bytes, 0 if lowbit else in_features * out_features * elem


def stays_lowbit_on_cpu(fmt: LinearFormat, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether a 4-/8-bit ``[out_features, in_features]`` weight of format ``fmt`` keeps its low-bit form on a CPU
    engine with activations in ``dtype``: 16-bit activations with the ``cpu_lowbit`` switch on
    (``use_cpu_lowbit``), and a shape torch's int4 GEMM takes (``kernels.cpu_lowbit.lowbit_takes`` on the
    run-time group: e.g. not the groups of 16 of a Q4_K_M file's Q6_K layers); elsewhere ``pack_for_cpu`` keeps
    a dense copy. The rule the memory estimates (:func:`linear_nbytes`, ``quant_embed.table_cpu_copy_nbytes``)
    count by."""
    return use_cpu_lowbit(dtype) and lowbit_takes(4 if fmt.kind == "w4" else 8, out_features, in_features,
                                                  fmt.runtime_group_size(in_features))
