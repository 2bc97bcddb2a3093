"""The ``torch_cpu`` backend's mixture of experts: every expert computed only on the tokens routed to it.

The ``T x top_k`` (token, slot) pairs of a batch are sorted by expert (one ``argsort``), the tokens gathered
in that order, and each expert that received any runs its two GEMMs on its contiguous slice; the outputs,
scaled by the routing weights, are added back to their tokens (``index_add_``). Work is proportional to the
routed pairs, not to ``T x E``.

The weights are prepared once per layer (:func:`prepare_experts`, kept in ``ExpertWeights.prepared``):

* ``onednn``: fp32, each expert's weight (W4 experts dequantized once, as ``W4A16Linear.pack_for_cpu`` does for a
  linear) reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what
  ``layers/cpu_gemm.py`` does for the dense linears): exact, 4 bytes per weight, 1.5-3.5x faster than
  ``F.linear`` from 4 rows on (2048 x 768 at 16 rows: 744 -> 309 us, one thread). What an fp32 engine uses.
* ``dense``: one ``[E, N, K]`` tensor in the activation dtype, ``F.linear``: the fallback.
* ``c``: the C 4-bit product of the dense layers (``cpu_native.w4_linear``: activations int16 per block of 32,
  or int8 with ``LIGHTINFER_CPU_W4=int8``) over each expert's codes in that product's layout with fp16
  ``(d, m)`` per group: half a byte per weight, as ``int4``, and the same product the decoder's 4-bit layers use.
  What a bf16/fp16 engine uses where the C library builds and the group is a multiple of 32 (and scales fit
  fp16: else ``int4``), any N; and the host-resident experts of a GPU engine (``--cpu-experts``).
* ``int4``: torch's CPU int4 GEMM (``_weight_int4pack_mm_for_cpu``, what the torch wheel ships) over each
  expert's codes, with the zero point folded into a float offset per group (``(8 - z) * s``, exact for
  fractional zeros too): half a byte per weight, activations in 16 bits. What a bf16/fp16 engine uses without
  the C library (or with ``LIGHTINFER_CPU_W4=torch``), where a 30B model's experts must stay 4-bit all the same.
  torch's kernel takes N a multiple of 16; other shapes fall back to ``dense``.

Every form of a W4 stack is a copy of it: once a layer is prepared for good (``FusedMoE.pack_for_cpu``) the layer
releases the W4 stack (meta tensors), and :func:`added_copy_nbytes` counts what the copy adds beyond it.

Measured on this shared 2-core machine (noisy; 768 x 2048, g128, one thread, best of 30): the int4 GEMM
with bf16 activations 41 / 73 / 284 us at 1 / 4 / 16 rows against 70 / 242 / 601 us for an fp32 dense
``F.linear``; with fp32 activations torch's int4 kernel takes a slow path (2.3 ms at one row), hence
``dense`` for fp32 engines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_native, switches
from .cpu_lowbit import dm_fits_fp16
from .moe import ExpertWeights, check_moe_args
from .w4_layout import dequantize_w4, unpack_int4_rows

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 GEMM takes


def int4_gemm_available() -> bool:
    """Whether this torch ships the CPU int4 GEMM."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


@dataclass
class CpuExperts:
    """Stacked experts in the form the CPU GEMMs read (module docstring).

    Attributes:
        kind: ``"dense"``, ``"onednn"``, ``"c"`` or ``"int4"``.
        dtype: the activation dtype they were prepared for.
        weight: ``dense``: ``[E, N, K]`` in ``dtype``.
        packed: ``int4``: per expert torch's packed codes; scale_zeros ``[E, K // G, N, 2]`` in ``dtype``
            (scale, and the float offset ``(8 - z) * s``); group_size G. ``c``: per expert uint8 ``[N, K / 2]``
            in ``cpu_native.w4_pack``'s layout; scale_zeros fp16 ``[E, N, 2, K // G]`` (d, then m = -z s).
        int8_activations: ``c`` with ``LIGHTINFER_CPU_W4=int8``.
    """

    kind: str
    dtype: torch.dtype
    weight: torch.Tensor | None = None
    packed: list[torch.Tensor] | None = None  # int4: torch's int4 packing; onednn: oneDNN's blocked fp32
    scale_zeros: torch.Tensor | None = None
    group_size: int = 0
    int8_activations: bool = False

    def matmul(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W_expert^T`` -> ``[M, N]`` in ``x.dtype``."""
        if self.kind == "dense":
            return F.linear(x, self.weight[expert])
        if self.kind == "c":
            xc = x.contiguous() if x.dtype in (torch.float32, torch.bfloat16) else x.to(torch.float32).contiguous()
            y = cpu_native.w4_linear(xc, self.packed[expert], self.scale_zeros[expert], self.group_size, None,
                                     xc.dtype, self.int8_activations)
            if y is None:
                raise RuntimeError("the C 4-bit product is unavailable after the experts were prepared for it")
            return y.to(x.dtype)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed[expert], None, "none", [], "")
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed[expert], self.group_size,
                                                           self.scale_zeros[expert])

    def nbytes(self) -> int:
        if self.kind == "dense":
            return self.weight.numel() * self.weight.element_size()
        if self.kind == "onednn":
            return sum(p.numel() * 4 for p in self.packed)  # opaque fp32 tensors
        return sum(p.numel() for p in self.packed) + self.scale_zeros.numel() * self.scale_zeros.element_size()


ONEDNN_BATCH_HINT = 64  # as layers/cpu_gemm.py: oneDNN picks its blocking for this many rows


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether oneDNN's prepacked fp32 GEMM exists here and matches ``F.linear`` (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 40, generator=gen), torch.randn(5, 40, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError):  # op missing or unsupported on this CPU
        return False


def c_product_available() -> bool:
    """Whether the C 4-bit product serves W4 experts: the C library builds and ``LIGHTINFER_CPU_W4`` is not
    ``torch``."""
    return switches.current().cpu_w4 != "torch" and cpu_native.library() is not None


def cpu_expert_kind(is_quantized: bool, dtype: torch.dtype, out_features: int, group_size: int) -> str:
    """The CPU form of one expert stack (module docstring): for W4 experts (``is_quantized``) with 16-bit
    activations ``c`` where the C product serves (:func:`c_product_available`, ``group_size`` G a multiple of 32),
    else ``int4`` where torch's kernel takes the shape (``out_features`` N a multiple of 16, G one of
    :data:`INT4_GROUP_SIZES`); ``onednn`` for fp32 activations where oneDNN works; else ``dense``. The one rule
    :func:`prepare_experts` prepares by and :func:`prepared_copy_nbytes` (the engine's estimates) counts by."""
    if (is_quantized and dtype in (torch.bfloat16, torch.float16) and group_size % cpu_native.W4_BLOCK == 0
            and c_product_available()):
        return "c"
    if (is_quantized and dtype in (torch.bfloat16, torch.float16) and int4_gemm_available()
            and out_features % 16 == 0 and group_size in INT4_GROUP_SIZES):
        return "int4"
    if dtype == torch.float32 and onednn_available():
        return "onednn"
    return "dense"


def choose_kind(w: ExpertWeights, dtype: torch.dtype) -> str:
    """:func:`cpu_expert_kind` of the stack ``w`` for activations of ``dtype``."""
    return cpu_expert_kind(w.is_quantized, dtype, w.out_features, w.group_size)


def prepared_copy_nbytes(is_quantized: bool, dtype: torch.dtype, num_experts: int, out_features: int,
                         in_features: int, group_size: int) -> int:
    """Bytes of the copy :func:`prepare_experts` makes of a stack of ``num_experts`` ``[N, K]`` experts (W4 with
    group ``group_size`` when ``is_quantized``, else dense in ``dtype``, as ``FusedMoE`` builds them in the
    activation dtype) for activations of ``dtype``, by arithmetic on :func:`cpu_expert_kind` (nothing built).

    ``int4``: torch's packed codes (uint8 ``[N, K // 2]`` per expert) and scale_zeros ``[E, K // G, N, 2]`` in
    ``dtype``; ``c``: the same sizes (codes, and an fp16 pair per group and row); ``onednn``: 4 bytes per weight; ``dense``: the dequantized ``[E, N, K]`` in ``dtype`` for W4
    experts, 0 for dense ones (the stack itself, not a copy: ``FusedMoE.prepared_nbytes`` counts it so).
    """
    e, n, k = num_experts, out_features, in_features
    elem = torch.empty(0, dtype=dtype).element_size()
    kind = cpu_expert_kind(is_quantized, dtype, n, group_size)
    if kind == "c":
        return e * (n * k // 2 + (k // group_size) * n * 2 * 2)
    if kind == "int4":
        return e * (n * k // 2 + (k // group_size) * n * 2 * elem)
    if kind == "onednn":
        return e * n * k * 4
    return e * n * k * elem if is_quantized else 0


def w4_stack_nbytes(dtype: torch.dtype, num_experts: int, out_features: int, in_features: int,
                    group_size: int) -> int:
    """Bytes of a W4 stack in the run-time layout (``moe.ExpertWeights``): int32 codes ``[E, N, K // 8]`` (half a
    byte per weight) and scales and zeros ``[E, K // G, N]`` in ``dtype``."""
    elem = torch.empty(0, dtype=dtype).element_size()
    e, n, k = num_experts, out_features, in_features
    return e * (n * k // 2 + 2 * (k // group_size) * n * elem)


def added_copy_nbytes(is_quantized: bool, dtype: torch.dtype, num_experts: int, out_features: int,
                      in_features: int, group_size: int) -> int:
    """Bytes the CPU preparation adds to a stack's memory: :func:`prepared_copy_nbytes` less the W4 stack it
    releases (``FusedMoE.pack_for_cpu`` puts a W4 stack on the meta device once every kind's copy replaces it:
    int4, prepacked fp32 and a dequantized dense copy alike; a dense stack is kept, its copy counted whole).

    So ``int4`` and ``c``: 0 (the same sizes in another layout); ``onednn``: 4 bytes per weight, less the W4 stack;
    ``dense`` from W4: the dequantized ``[E, N, K]`` in ``dtype``, less the W4 stack; dense 16-bit experts: 0.
    Never negative for the group sizes a W4 stack takes (G >= 8)."""
    copy = prepared_copy_nbytes(is_quantized, dtype, num_experts, out_features, in_features, group_size)
    if not is_quantized:
        return copy
    return copy - w4_stack_nbytes(dtype, num_experts, out_features, in_features, group_size)


@torch.no_grad()
def prepare_experts(w: ExpertWeights, dtype: torch.dtype, kind: str | None = None) -> CpuExperts:
    """``w`` (on the CPU) in the form :func:`fused_moe` computes with for activations of ``dtype``
    (``kind`` None: :func:`choose_kind`). Made expert by expert: the peak is one expert's temporaries.

    Raises:
        RuntimeError: ``w``'s tensors are on the meta device (stacks released after an earlier preparation,
            ``FusedMoE.pack_for_cpu``): there is nothing to prepare from, and meta ops would "compute" silently.
    """
    if w.device.type == "meta":
        raise RuntimeError("prepare_experts: the expert stacks are on the meta device (released once their CPU "
                           "copy was made for another dtype, or never loaded); nothing to prepare from. Reload "
                           "the model for activations of this dtype")
    kind = kind or choose_kind(w, dtype)
    if kind == "onednn":
        return CpuExperts("onednn", dtype, packed=[
            torch.ops.mkldnn._reorder_linear_weight(w.dense(e).to(torch.float32).contiguous(), ONEDNN_BATCH_HINT)
            for e in range(w.num_experts)])
    if kind == "dense":
        if not w.is_quantized:
            return CpuExperts("dense", dtype, weight=w.weight.to(dtype))
        out = torch.empty(w.num_experts, w.out_features, w.in_features, dtype=dtype)
        for e in range(w.num_experts):
            out[e] = dequantize_w4(w.qweight[e], w.scales[e], w.zeros[e]).to(dtype)
        return CpuExperts("dense", dtype, weight=out)
    if kind == "c":
        experts = _prepare_c(w, dtype)
        if experts is not None:
            return experts
        # scales fp16 cannot hold (never in AWQ's or GGUF's fp16 ones): torch's layout, else dense
        kind = "int4" if int4_gemm_available() and w.out_features % 16 == 0 and \
            w.group_size in INT4_GROUP_SIZES else "dense"
        return prepare_experts(w, dtype, kind)
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4_rows(w.qweight[e]), 1)
              for e in range(w.num_experts)]
    s = w.scales.to(torch.float32)
    scale_zeros = torch.stack([s, (8.0 - w.zeros.to(torch.float32)) * s], dim=-1).to(dtype).contiguous()
    return CpuExperts("int4", dtype, packed=packed, scale_zeros=scale_zeros, group_size=w.group_size)


def _prepare_c(w: ExpertWeights, dtype: torch.dtype) -> CpuExperts | None:
    """The ``c`` form of a W4 stack, or None where a scale or offset is outside fp16's normal range."""
    s = w.scales.to(torch.float32)  # [E, K // G, N]
    m = -w.zeros.to(torch.float32) * s
    if not dm_fits_fp16(s, m):
        return None
    packed = []
    for e in range(w.num_experts):
        codes = cpu_native.w4_pack(unpack_int4_rows(w.qweight[e]).to(torch.uint8).contiguous())
        if codes is None:
            return None
        packed.append(codes)
    dm = torch.stack([s.transpose(1, 2), m.transpose(1, 2)], dim=2).to(torch.float16).contiguous()  # [E, N, 2, K/G]
    return CpuExperts("c", dtype, packed=packed, scale_zeros=dm, group_size=w.group_size,
                      int8_activations=switches.current().cpu_w4 == "int8")


def prepared_for(w: ExpertWeights, dtype: torch.dtype) -> CpuExperts:
    """``w.prepared`` when it was made for ``dtype``, else prepared now and kept there."""
    p = w.prepared
    if not isinstance(p, CpuExperts) or p.dtype != dtype:
        p = w.prepared = prepare_experts(w, dtype)
    return p


def fused_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``reference.fused_moe``'s result, each expert computed on the tokens routed to it (module docstring).

    Args:
        x: ``[T, H]``; w13 ``[E, 2 I, H]``, w2 ``[E, H, I]`` (``moe.ExpertWeights``, on the CPU);
        topk_weights: float ``[T, top_k]``; topk_ids: int ``[T, top_k]``.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    t, h, _ = check_moe_args(x, w13, w2, topk_weights, topk_ids)
    # a recorded decode step repeats fixed calls; which experts run on which rows is chosen here, per step
    cpu_native.declined("fused_moe", "the experts' calls depend on each step's routing")
    gate_up, down = prepared_for(w13, x.dtype), prepared_for(w2, x.dtype)
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    xs = x.index_select(0, token_of)  # [T * top_k, H], grouped by expert
    ys = torch.empty(t * top_k, h, dtype=x.dtype)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=w13.num_experts).tolist()):
        if count:
            g_u = gate_up.matmul(e, xs[start:start + count])
            half = g_u.shape[1] // 2
            act = (F.silu(g_u[:, :half].to(torch.float32)) * g_u[:, half:].to(torch.float32)).to(x.dtype)
            ys[start:start + count] = down.matmul(e, act)
            start += count
    weights = topk_weights.reshape(-1).to(torch.float32).index_select(0, order)
    out = torch.zeros(t, h, dtype=torch.float32).index_add_(0, token_of, ys.to(torch.float32) * weights[:, None])
    return out.to(x.dtype)
