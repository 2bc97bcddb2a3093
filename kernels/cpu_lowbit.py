"""Low-bit weights on the CPU: 4- and 8-bit linears that stay 4-/8-bit in memory.

The CPU matrix product of ``W4A16Linear`` / ``W8A16Linear`` (and of the experts of a MoE layer), chosen by
measuring the candidates at SmolLM2's shapes (``bench/cpu_gemm.py`` (at commit 220074d), ``bench/kernels/cpu_w4.py``,
``docs/cpu_performance.md``). A weight is converted once, at load time, by :func:`prepare_w4` /
:func:`prepare_w8` into a form opaque to callers, and used by :func:`quant_linear`:

* **W4** (AWQ, GPTQ, compressed-tensors, GGUF Q4_0/Q4_1/Q4_K, all already in the W4 run-time layout of
  ``w4_layout.py``), ``LIGHTINFER_CPU_W4`` choosing the product:

  - ``c`` (the default, where the C library of ``cpu_native.py`` builds): :class:`CpuW4Weight`, the codes in
    that library's layout (blocks of 32 interleaved by 8) with fp16 ``(d, m)`` per group (no more bytes than
    torch's layout), for ``cpu_native.w4_linear``: activations held as int16 per block of 32 for integer dot
    products, within ~1e-5 of the exact product (twin ``reference.w4_act_gemm``); from
    ``cpu_native.dense_rows`` rows (a prefill, a batched decode step) bf16 inputs run on AMX tiles where the
    CPU has them (``native/cpu_w4_amx.c``: 32 rows of the weight dequantized to bf16 at a time in cache, fp32
    sums; from 5 rows), else the weight is dequantized by slices for torch's dense GEMM: fp32, 0.6-0.7x the
    time of torch's int4 GEMM at 512 rows, or bf16 where the CPU multiplies bf16 in hardware, ~4x faster again.
  - ``int8``: the same weight, activations quantized to int8 per block of 32 (llama.cpp's Q8 activations;
    twin ``reference.w4_act_gemm(..., bits=8)``). Not the default: each layer's output moves by ~1% (10% of
    the logits' norm on SmolLM2, against 3% for the default), and greedy answers of a small model fork more
    often, for a few percent of decode speed (``docs/cpu_performance.md``).
  - ``torch`` (and where the C library does not build, or scales fp16 cannot hold): torch's
    ``_weight_int4pack_mm_for_cpu`` (x86 and aarch64 wheels; bf16 activations, fp32 accumulation) on its packed
    codes plus ``[K // G, N, 2]`` bf16 (scale, offset) pairs, where torch's kernel computes
    ``w = (q - 8) * scale + offset``; our ``w = (q - z) * s`` is that with ``offset = (8 - z) * s``.
* **W8** (GGUF Q8_0 / Q5_* / Q6_K, 8-bit GPTQ; the W8 layout of ``reference.py``): each int8 code splits
  exactly into two 4-bit codes, ``q = 16 * hi + lo`` with ``hi = q >> 4`` in -8..7 and ``lo = q & 15``, so
  ``(q - z) * s = (hi_code - 8) * 16 s + (lo_code - 8) * s + (8 - z) * s``: two int4 weights stacked along
  N, one GEMM over ``2 N`` outputs, and one add of the halves. The codes are the file's, bit for bit.

torch's kernel takes group sizes 32, 64, 128 and 256 and ``N`` a multiple of 16; a larger group (e.g. one
per output channel) is expressed with a smaller one by repeating its scale. Shapes it cannot take
(a group of 16, as Q6_K's; ``N`` not a multiple of 16 for W4, of 8 for W8) get None from the prepare
functions, and the layer keeps its exact dequantized fallback (the C products follow the same rule, so that
the memory estimates hold whichever runs). The math of torch's paths is the reference twins'
(``reference.w4a16_gemm`` / ``w8a16_gemm``), with bf16 activations: the tests hold them together.

* **W8 LM head** (a vocabulary table, e.g. SmolLM2's tied Q8_0 embedding / head): requantized once to one
  int8 scale per output row (:func:`prepare_w8_per_channel`, :class:`CpuInt8Weight`) for the C product of
  ``cpu_native.w8_linear`` (activations int16 per row; 0.5-0.6x the time of torch's ``_weight_int8pack_mm`` at
  1 and 16 rows, 49,152 x 576, AVX-512 Xeon 2026-12-06), or torch's (bf16 activations) with
  ``LIGHTINFER_CPU_W4=torch`` or no C compiler. Per row, not as two int4 halves: the halves decode their
  weight twice per few rows, and the
  LM head is the largest product of a step: 49,152 x 576 at 2 threads, 1 / 16 rows, 4.2 / 23.6 ms as halves
  against 1.5 / 16.5 ms (AVX2), and 2.35 / 13.7 against 1.9 / 7.7 ms at one thread (AVX-512,
  ``bench/results/cpu_gemm*.md`` at commits 86ea725, 26f9625 and 47224d0); held-out perplexity 15.39 against 15.44 with the halves (SmolLM2 GGUF,
  8,192 tokens). Only the head: elsewhere the file's codes stay as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu_native, switches
from .w4_layout import unpack_int4_rows

INT4_GROUP_SIZES = (256, 128, 64, 32)  # what torch's CPU int4 GEMM takes (largest first)
COMPUTE_DTYPE = torch.bfloat16  # the activation dtype of torch's fast CPU int4 path (fp32/fp16: naive loops)
_PACK_ROWS = 4096  # rows packed per call at load: bounds the int32 code temporaries (a multiple of 64)


def int4_gemm_available() -> bool:
    """Whether this torch ships the CPU int4 GEMM (``_weight_int4pack_mm_for_cpu`` and its packer)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


@dataclass
class CpuQuantWeight:
    """A 4- or 8-bit weight prepared for :func:`quant_linear` (module docstring). Opaque to callers.

    Attributes:
        out_features, in_features: N and K of ``y = x W^T``.
        packed: uint8, torch's packed int4 codes of ``num_splits * N`` rows.
        scale_offset: bf16 ``[K // group_size, num_splits * N, 2]``.
        group_size: the int4 kernel's group (32..256).
        num_splits: 1 (W4) or 2 (W8: the high and low nibbles, summed).
        input_perm: None, or int64 ``[K]``: the stored K order is ``x[..., input_perm]`` (act-order).
    """

    out_features: int
    in_features: int
    packed: torch.Tensor
    scale_offset: torch.Tensor
    group_size: int
    num_splits: int = 1
    input_perm: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and offsets)."""
        return (self.packed.numel() * self.packed.element_size()
                + self.scale_offset.numel() * self.scale_offset.element_size())


def _kernel_group(group_size: int, k: int) -> int | None:
    """The largest group the int4 kernel takes that divides ``group_size`` (and so K), or None."""
    return next((g for g in INT4_GROUP_SIZES if group_size % g == 0 and k % g == 0), None)


def lowbit_takes(bits: int, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether :func:`prepare_w4` (``bits`` 4) / :func:`prepare_w8` (``bits`` 8) take an ``[N, K]`` weight with
    groups of ``group_size`` along K (module docstring: the int4 op in this torch, N a multiple of 16 for W4 and
    of 8 for W8, a kernel group dividing G); where not, the layer keeps its dense fallback. The one rule the
    prepare functions and the engine's memory estimates (``layers.linear.stays_lowbit_on_cpu``) follow."""
    return (int4_gemm_available() and out_features % (16 if bits == 4 else 8) == 0
            and _kernel_group(group_size, in_features) is not None)


def _pack_rows(rows: int, codes_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """torch's packed layout of ``rows`` rows whose int32 codes (0..15) ``codes_of(start, end)`` gives, made
    in chunks of rows: the packer takes one int32 per code, and small chunks keep those temporaries in cache."""
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    if rows <= _PACK_ROWS or rows % 64:  # the layout is blocked by 64 rows: chunks must keep that alignment
        return pack(codes_of(0, rows).contiguous(), 1)
    return torch.cat([pack(codes_of(i, min(i + _PACK_ROWS, rows)).contiguous(), 1)
                      for i in range(0, rows, _PACK_ROWS)])


def _w4_codes(qweight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """int32 codes ``[end - start, K]`` of rows ``start:end`` of a W4 ``qweight`` (int32 ``[N, K // 8]``)."""
    if sys.byteorder != "little":
        return unpack_int4_rows(qweight[start:end])
    # Little-endian words: byte b of a row holds codes 2b (low nibble) and 2b + 1 (high nibble); working on
    # bytes moves a quarter of the data that shifting int32 words would.
    b = qweight[start:end].contiguous().view(torch.uint8)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(end - start, -1).to(torch.int32)


def _scale_offset(scales: torch.Tensor, offsets: torch.Tensor, group_size: int, kernel_group: int) -> torch.Tensor:
    """fp32 ``[K // G, R]`` scales and offsets -> bf16 ``[K // g, R, 2]`` for the kernel's group ``g``."""
    pairs = torch.stack([scales, offsets], dim=-1)
    if kernel_group != group_size:  # a coarser group is the finer one with its values repeated
        pairs = pairs.repeat_interleave(group_size // kernel_group, dim=0)
    return pairs.to(COMPUTE_DTYPE).contiguous()


@dataclass
class CpuW4Weight:
    """A 4-bit weight for the C product (``cpu_native.w4_linear``). Opaque to callers.

    Attributes:
        out_features, in_features: N and K.
        packed: uint8 ``[N, K / 2]``, the codes in ``cpu_native.w4_pack``'s layout.
        dm: fp16 ``[N, 2, K / group_size]``: each row's scales ``d`` then offsets ``m``, ``w = d * q + m`` per
            group (``d = s``, ``m = -z s``).
        group_size: G, a multiple of 32.
        input_perm: as :class:`CpuQuantWeight`'s.
        int8_activations: activations quantized to int8 per block of 32 (``LIGHTINFER_CPU_W4=int8``).
    """

    out_features: int
    in_features: int
    packed: torch.Tensor
    dm: torch.Tensor
    group_size: int
    input_perm: torch.Tensor | None = None
    int8_activations: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and offsets)."""
        return self.packed.numel() + self.dm.numel() * 2


_FP16_MAX, _FP16_TINY = 65504.0, 2.0 ** -14  # a (d, m) outside fp16's normal range keeps torch's layout


def dm_fits_fp16(scales: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether fp32 scales ``d`` and offsets ``m`` (any shape) keep their precision as the C layout's fp16: all
    finite, none beyond fp16's range, no nonzero scale below its normal range (AWQ's and GGUF's fp16 scales
    always do). Where not, a weight keeps torch's int4 layout (MoE experts too, ``moe_cpu.py``)."""
    a = scales.abs()
    return bool(torch.isfinite(scales).all() and torch.isfinite(offsets).all()) and float(a.max()) <= _FP16_MAX \
        and float(offsets.abs().max()) <= _FP16_MAX and not bool(((a < _FP16_TINY) & (a > 0)).any())


def _prepare_w4_c(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  input_perm: torch.Tensor | None) -> CpuW4Weight | None:
    """The C product's layout, or None where it does not apply (``LIGHTINFER_CPU_W4=torch``, no C library, K or
    G not a multiple of 32, or scales fp16 would round badly: AWQ and GGUF scales are fp16 already, exact)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group_size = k // scales.shape[0]
    mode = switches.current().cpu_w4
    if mode == "torch" or k % cpu_native.W4_BLOCK or group_size % cpu_native.W4_BLOCK:
        return None
    s = scales.to(torch.float32)
    m = -zeros.to(torch.float32) * s
    if not dm_fits_fp16(s, m):
        return None
    chunks = []
    for start in range(0, n, _PACK_ROWS):  # bounded temporaries: one byte per code for _PACK_ROWS rows at a time
        codes = _w4_codes(qweight, start, min(start + _PACK_ROWS, n)).to(torch.uint8)
        packed = cpu_native.w4_pack(codes)
        if packed is None:
            return None
        chunks.append(packed)
    dm = torch.stack([s.t(), m.t()], dim=1).to(torch.float16).contiguous()  # [N, 2, K / G]
    return CpuW4Weight(n, k, torch.cat(chunks) if len(chunks) > 1 else chunks[0], dm, group_size,
                       None if input_perm is None else input_perm.to(torch.int64), mode == "int8")


@torch.no_grad()
def prepare_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               input_perm: torch.Tensor | None = None) -> CpuQuantWeight | CpuW4Weight | None:
    """The W4 run-time layout (``w4_layout.py``: int32 ``[N, K // 8]``, scales and zeros ``[K // G, N]``) in
    the form :func:`quant_linear` reads, or None where torch's int4 GEMM cannot take it (no such op in this
    torch, ``N`` not a multiple of 16, or no kernel group dividing ``G``).

    Where the C library (``cpu_native``) builds, a :class:`CpuW4Weight` for the C product (module docstring;
    ``LIGHTINFER_CPU_W4`` chooses its activations, or torch's layout with ``torch``); else torch's int4 GEMM
    layout."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group_size = k // scales.shape[0]
    if qweight.device.type != "cpu" or not lowbit_takes(4, n, k, group_size):
        return None
    native = _prepare_w4_c(qweight, scales, zeros, input_perm)
    if native is not None:
        return native
    kernel_group = _kernel_group(group_size, k)
    s = scales.to(torch.float32)
    offsets = (8.0 - zeros.to(torch.float32)) * s
    return CpuQuantWeight(n, k, _pack_rows(n, lambda a, b: _w4_codes(qweight, a, b)),
                          _scale_offset(s, offsets, group_size, kernel_group), kernel_group, 1,
                          None if input_perm is None else input_perm.to(torch.int64))


@torch.no_grad()
def prepare_w8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               input_perm: torch.Tensor | None = None) -> CpuQuantWeight | None:
    """The W8 run-time layout (``reference.py``: int8 ``[N, K]``, fp32 scales and optional zeros
    ``[K // G, N]``) as two exact int4 halves (module docstring), or None where the int4 GEMM cannot take it
    (no such op, ``N`` not a multiple of 8, or no kernel group dividing ``G``, e.g. Q6_K's 16)."""
    n, k = qweight.shape
    group_size = k // scales.shape[0]
    if qweight.device.type != "cpu" or not lowbit_takes(8, n, k, group_size):
        return None
    kernel_group = _kernel_group(group_size, k)
    s = scales.to(torch.float32)
    z = torch.zeros_like(s) if zeros is None else zeros.to(torch.float32)
    # hi half: (hi_code - 8) * 16 s, offset 0; lo half: (lo_code - 8) * s + (8 - z) * s
    pairs_s = torch.cat([16.0 * s, s], dim=1)
    pairs_o = torch.cat([torch.zeros_like(s), (8.0 - z) * s], dim=1)
    # hi = q >> 4 (arithmetic: -8..7) stored as hi + 8; lo = q & 15. Rows 0..N-1 are the hi halves, N..2N-1 the lo.
    hi = _pack_rows(n, lambda a, b: (qweight[a:b].to(torch.int32) >> 4) + 8)
    lo = _pack_rows(n, lambda a, b: qweight[a:b].to(torch.int32) & 15)
    return CpuQuantWeight(n, k, torch.cat([hi, lo]) if n % 64 == 0 else _pack_rows(
                              2 * n, lambda a, b: _w8_halves(qweight, a, b)),
                          _scale_offset(pairs_s, pairs_o, group_size, kernel_group), kernel_group, 2,
                          None if input_perm is None else input_perm.to(torch.int64))


def _w8_halves(qweight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """int32 codes of rows ``start:end`` of the stacked ``[hi; lo]`` halves of a W8 ``qweight`` ``[N, K]``."""
    q = qweight.to(torch.int32)
    return torch.cat([(q >> 4) + 8, q & 15])[start:end]


def int8pack_available() -> bool:
    """Whether this torch ships the CPU int8 weight-only GEMM (``_weight_int8pack_mm``)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


# torch's int8 weight-only kernel reads K in vectors: K = 36 or 44 crashed it and K = 33 gave wrong sums on an
# AVX2 CPU (2026-12-05), multiples of 8 were right; a multiple of 64 (every hidden size in use) is asked.
_INT8PACK_K_MULTIPLE = 64


def int8pack_takes(in_features: int) -> bool:
    """Whether :func:`prepare_w8_per_channel` takes a weight with ``in_features`` inputs (the op exists in this
    torch and K is a multiple of 64); where not, the layer keeps the two int4 halves."""
    return int8pack_available() and in_features % _INT8PACK_K_MULTIPLE == 0


@dataclass
class CpuInt8Weight:
    """An 8-bit weight requantized to one scale per output row, for :func:`int8_linear`. Opaque to callers.

    Attributes:
        out_features, in_features: N and K of ``y = x W^T``.
        qweight: int8 ``[N, K]``, ``W[n, k] ~= qweight[n, k] * scales[n]``.
        scales: bf16 ``[N]``.
        input_perm: None, or int64 ``[K]``: the stored K order is ``x[..., input_perm]`` (act-order).
        torch_product: multiplied by torch's ``_weight_int8pack_mm``, not the C product: the ``cpu_w4``
            switch was ``torch`` when it was prepared (decided then, so that an engine keeps its own setting).
    """

    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    input_perm: torch.Tensor | None = None
    torch_product: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held (codes and scales)."""
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


def int8_per_channel_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of the :class:`CpuInt8Weight` of an ``[out_features, in_features]`` weight (for the estimates)."""
    return out_features * in_features + out_features * COMPUTE_DTYPE.itemsize


@torch.no_grad()
def prepare_w8_per_channel(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           input_perm: torch.Tensor | None = None) -> CpuInt8Weight | None:
    """The W8 run-time layout (int8 ``[N, K]``, fp32 scales and optional zeros ``[K // G, N]``) requantized to
    one symmetric int8 scale per row (``max |w| / 127``, in bf16 as the kernel takes it), or None where
    :func:`int8pack_takes` says no. Rows are dequantized a chunk at a time (a vocabulary table in fp32 would be
    4x its codes)."""
    n, k = qweight.shape
    if qweight.device.type != "cpu" or not int8pack_takes(k):
        return None
    group_size = k // scales.shape[0]
    codes = torch.empty(n, k, dtype=torch.int8)
    row_scales = torch.empty(n, dtype=COMPUTE_DTYPE)
    for a in range(0, n, _PACK_ROWS):
        b = min(a + _PACK_ROWS, n)
        q = qweight[a:b].to(torch.float32).unflatten(1, (-1, group_size))
        if zeros is not None:
            q = q - zeros[:, a:b].t().unsqueeze(-1)
        w = (q * scales[:, a:b].t().unsqueeze(-1)).flatten(1)
        # the scale is rounded to bf16 first, and the codes divided by the rounded one: the product is the
        # kernel's, with no second rounding of the scale
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).to(COMPUTE_DTYPE)
        codes[a:b] = torch.round(w / s.to(torch.float32).unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        row_scales[a:b] = s
    return CpuInt8Weight(n, k, codes, row_scales, None if input_perm is None else input_perm.to(torch.int64),
                         switches.current().cpu_w4 == "torch")


def int8_linear(x: torch.Tensor, weight: CpuInt8Weight, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a :class:`CpuInt8Weight`: ``x [..., K]`` float -> ``[..., N]`` in
    ``out_dtype`` (default ``x.dtype``; fp32 for an LM head's logits), fp32 accumulation. The C product of
    ``cpu_native.w8_linear`` (x held as int16 per row) where the C library builds and the weight was not prepared
    for torch's product (``LIGHTINFER_CPU_W4=torch``: ``weight.torch_product``); else torch's
    ``_weight_int8pack_mm`` (x cast to bf16, its output bf16)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if weight.input_perm is not None:
        x2 = x2.index_select(1, weight.input_perm)
    out_dtype = out_dtype or x.dtype
    if not weight.torch_product and x2.dtype in (torch.float32, torch.bfloat16) and \
            out_dtype in (torch.float32, torch.bfloat16):
        b = None if bias is None else bias.to(torch.float32)
        y = cpu_native.w8_linear(x2.contiguous(), weight.qweight, weight.scales, b, out_dtype)
        if y is not None:
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.out_features)
    if x2.dtype != COMPUTE_DTYPE:
        x2 = x2.to(COMPUTE_DTYPE)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, weight.qweight, weight.scales)
    if bias is not None:
        y = y + bias
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.out_features)


def quant_linear(x: torch.Tensor, weight: CpuQuantWeight | CpuW4Weight, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for a prepared low-bit ``weight``.

    Args:
        x: ``[..., K]`` float (cast to bf16 for the kernel, which accumulates in fp32).
        weight: from :func:`prepare_w4` / :func:`prepare_w8`.
        bias: ``[N]`` or None.
        out_dtype: the result's dtype (default ``x.dtype``); bf16 saves a cast where the next op takes it.
    Returns:
        ``[..., N]``.
    """
    # Called ~120 times a decode step: the Python around the kernel is kept to what the inputs need.
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if weight.input_perm is not None:
        x2 = x2.index_select(1, weight.input_perm)
    if type(weight) is CpuW4Weight:
        out_dtype = out_dtype or x.dtype
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.to(torch.float32)
        if bias is not None and bias.dtype != torch.float32:
            cpu_native.declined("w4_linear", f"a {bias.dtype} bias, converted to fp32 at each call")
            bias = bias.to(torch.float32)
        y = cpu_native.w4_linear(x2, weight.packed, weight.dm, weight.group_size, bias,
                                 out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32,
                                 weight.int8_activations)
        if y is None:
            raise RuntimeError("the C 4-bit product is unavailable after its weight was prepared for it")
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.out_features)
    if x2.dtype != COMPUTE_DTYPE:
        x2 = x2.to(COMPUTE_DTYPE)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight.packed, weight.group_size, weight.scale_offset)
    n = weight.out_features
    if weight.num_splits == 2:  # W8: the two nibble halves, added in fp32 (the high one is ~16x larger)
        y = y[:, :n].to(torch.float32) + y[:, n:]
    if bias is not None:
        y = y + bias
    out_dtype = out_dtype or x.dtype
    if y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
