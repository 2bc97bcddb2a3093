"""The CPU matrix-product candidates that bench/cpu_gemm.py measures, each built from one fp32 weight.

Every builder takes the fp32 weight ``w [N, K]`` and its 4-bit group quantization (:class:`Quant4`,
asymmetric, ``w ~ (q - z) * s`` per group of ``G`` along K, as AWQ and GGUF Q4_1 store it) and
returns a :class:`Candidate`: ``fn(x fp32 [M, K]) -> y [M, N]`` (activation casts included in the
call, output left in the kernel's dtype), the bytes its weight format keeps in memory, and the
fp32 weight it stands for (for its own numerical error). A builder raises when its op is missing
or refuses the shape; the caller records that as "skipped" with the reason.

torchao's candidates live in :func:`torchao_candidates` and run in ``.peers/torchao-venv`` (a
separate venv: torchao is not a project dependency).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Quant4:
    """4-bit asymmetric group quantization of ``w [N, K]``: ``q`` uint8 [N, K] in 0..15, ``s``/``z`` fp32 [N, K/G]."""

    q: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor
    group_size: int

    @staticmethod
    def of(w: torch.Tensor, group_size: int) -> Quant4:
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"K={k} is not a multiple of group size {group_size}")
        wg = w.reshape(n, k // group_size, group_size)
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8)
        z = torch.round(-lo / s).clamp(0, 15)
        q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15)
        return Quant4(q.reshape(n, k).to(torch.uint8), s, z, group_size)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.reshape(n, k // self.group_size, self.group_size).float()
        return ((q - self.z[..., None]) * self.s[..., None]).reshape(n, k)

    def packed(self) -> torch.Tensor:
        """uint8 [N, K/2], two weights a byte, even k in the low nibble."""
        return self.q[:, 0::2] | (self.q[:, 1::2] << 4)


@dataclass
class Candidate:
    fn: Fn
    weight_bytes: int
    reference: torch.Tensor  # fp32 [N, K]: the weight this candidate computes with, ideally
    max_rows: int | None = None  # measured only up to this many rows (a GEMV form)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- dense (fp32, bf16)
def fp32_linear(w: torch.Tensor, q4: Quant4) -> Candidate:
    return Candidate(lambda x: F.linear(x, w), _nbytes(w), w)


def fp32_prepacked(w: torch.Tensor, q4: Quant4) -> Candidate:
    """lightinfer's CPU path today: the weight reordered once into oneDNN's blocked layout."""
    from lightinfer.layers.cpu_gemm import PackedWeight, onednn_gemm_available

    if not onednn_gemm_available():
        raise RuntimeError("oneDNN prepacked GEMM unavailable or wrong here")
    packed = PackedWeight(w)
    return Candidate(lambda x: packed(x), packed.nbytes, w)


def bf16_linear(w: torch.Tensor, q4: Quant4) -> Candidate:
    wb = w.to(torch.bfloat16)
    return Candidate(lambda x: F.linear(x.to(torch.bfloat16), wb), _nbytes(wb), wb.float())


# ---------------------------------------------------------------- torch's int4 CPU kernel
def int4pack_for_cpu(group_size: int) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """``_weight_int4pack_mm_for_cpu`` (bf16 activations), requantized to ``group_size`` from the fp32 weight.

    Its math is ``w = (q - 8) * scale + zero`` per group: the zero it takes is ``(8 - z) * s``.
    """

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        q = q4 if q4.group_size == group_size else Quant4.of(w, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.q.to(torch.int32), 2)
        sz = torch.stack([q.s.t(), ((8 - q.z) * q.s).t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, sz)

        return Candidate(fn, _nbytes(packed, sz),
                         q.dequantize())

    return build


def lightinfer_w4(product: str) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """What lightinfer's CPU engine runs for a W4 layer (``kernels/cpu_lowbit.py``): the W4 run-time layout
    prepared once, the casts in and out included; ``product`` is a ``LIGHTINFER_CPU_W4`` value: ``c`` (the C
    product, activations int16 per block of 32; the default), ``int8`` (the same with activations int8 per block of 32) or
    ``torch`` (torch's int4 GEMM, bf16 activations)."""

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        from lightinfer.kernels import cpu_quant_linear, pack_int4_rows, prepare_w4_cpu, switches
        from lightinfer.kernels.cpu_lowbit import CpuW4Weight

        with switches.override(cpu_w4=product):
            prepared = prepare_w4_cpu(pack_int4_rows(q4.q.to(torch.int32)), q4.s.t().contiguous(),
                                      q4.z.t().contiguous())
        if prepared is None or isinstance(prepared, CpuW4Weight) == (product == "torch"):
            raise RuntimeError("this layout cannot take the shape here (or the C library is unavailable)")
        return Candidate(lambda x: cpu_quant_linear(x, prepared), prepared.nbytes, q4.dequantize())

    return build


def lightinfer_w8(w: torch.Tensor, q4: Quant4) -> Candidate:
    """What lightinfer's CPU engine runs for a W8 layer (a GGUF Q8_0 tensor: int8 codes, one scale per 32):
    each code split exactly into two 4-bit halves, one int4 GEMM over both, the halves added in fp32."""
    from lightinfer.kernels import cpu_quant_linear, prepare_w8_cpu

    n, k = w.shape
    wg = w.reshape(n, k // 32, 32)
    scale = (wg.abs().amax(-1) / 127).clamp(min=1e-8)  # [N, K/32]
    q8 = torch.round(wg / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    prepared = prepare_w8_cpu(q8, scale.t().contiguous(), None)
    if prepared is None:
        raise RuntimeError("torch's CPU int4 GEMM cannot take this shape")
    return Candidate(lambda x: cpu_quant_linear(x, prepared), prepared.nbytes,
                     (q8.reshape(n, k // 32, 32).float() * scale[..., None]).reshape(n, k))


# ---------------------------------------------------------------- 8-bit weights
def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_weight_only(act: torch.dtype) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """``_weight_int8pack_mm``: int8 weight, per-channel scale, activations (and math) in ``act``."""

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        w8, scale = _int8_per_channel(w)
        sc = scale.to(act)
        return Candidate(lambda x: torch.ops.aten._weight_int8pack_mm(x.to(act), w8, sc), _nbytes(w8, sc),
                         w8.float() * scale[:, None])

    return build


def int8_dynamic(engine: str) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """``quantized::linear_dynamic`` on ``engine`` (fbgemm / onednn): int8 weight per channel, activations
    quantized to uint8 per tensor on every call.

    torch 2.13 deprecates the quantized tensor types this needs (qint8 weights, "will be removed in a
    future PyTorch release"): measured for comparison, a risky base to build on.
    """

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        if engine not in torch.backends.quantized.supported_engines:
            raise RuntimeError(f"quantized engine {engine} not in this torch")
        torch.backends.quantized.engine = engine
        w8, scale = _int8_per_channel(w)
        with warnings.catch_warnings():  # the deprecation above, once per shape
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(w8, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                                          0)
        packed = torch.ops.quantized.linear_prepack(qw, None)

        def fn(x: torch.Tensor) -> torch.Tensor:
            torch.backends.quantized.engine = engine  # the op dispatches on the global engine
            return torch.ops.quantized.linear_dynamic(x, packed, False)

        return Candidate(fn, _nbytes(w8, scale),
                         w8.float() * scale[:, None])

    return build


def int8_dynamic_per_row(w: torch.Tensor, q4: Quant4) -> Candidate:
    """Activations quantized to int8 per row (as llama.cpp's Q8 activations), ``torch._int_mm``, then rescaled."""
    w8, scale = _int8_per_channel(w)
    w8t = w8.t()  # [K, N]: _int_mm's second operand

    def fn(x: torch.Tensor) -> torch.Tensor:
        sx = (x.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
        xq = torch.round(x / sx).to(torch.int8)
        return torch._int_mm(xq, w8t) * sx * scale

    return Candidate(fn, _nbytes(w8, scale), w8.float() * scale[:, None])


# ---------------------------------------------------------------- dequantize in blocks, compile
def _q4_storage(q4: Quant4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed nibbles [N, K/2] and, per group, fp16 scale and offset with ``w = q * s + m`` (Q4_1's form)."""
    return q4.packed(), q4.s.half(), (-q4.z * q4.s).half()


def _dequant_rows(packed: torch.Tensor, s: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, K/2] nibbles + [n, K/G] scale, offset -> [n, K] weights in ``dtype``."""
    n, groups = s.shape
    q = torch.stack((packed & 15, packed >> 4), -1).view(n, groups, -1).to(dtype)
    return torch.addcmul(m[..., None].to(dtype), q, s[..., None].to(dtype)).view(n, -1)


def dequant_blocks(axis: str, dtype: torch.dtype, block_bytes: int) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """Dequantize ``block_bytes`` of weights at a time (rows of N, or columns of K) and multiply block by block."""

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        packed, s, m = _q4_storage(q4)
        n, k = w.shape
        g = q4.group_size
        if axis == "N":
            rows = max(16, block_bytes // (k * torch.finfo(dtype).bits // 8) // 16 * 16)

            def fn(x: torch.Tensor) -> torch.Tensor:
                xd = x.to(dtype)
                out = torch.empty(n, x.shape[0], dtype=dtype)  # y^T: each block writes whole rows
                for r0 in range(0, n, rows):
                    wb = _dequant_rows(packed[r0:r0 + rows], s[r0:r0 + rows], m[r0:r0 + rows], dtype)
                    torch.mm(wb, xd.t(), out=out[r0:r0 + rows])
                return out.t()
        else:
            cols = max(g, block_bytes // (n * torch.finfo(dtype).bits // 8) // g * g)

            def fn(x: torch.Tensor) -> torch.Tensor:
                xd = x.to(dtype)
                out = torch.zeros(x.shape[0], n, dtype=dtype)
                for c0 in range(0, k, cols):
                    c1 = min(k, c0 + cols)
                    wb = _dequant_rows(packed[:, c0 // 2:c1 // 2], s[:, c0 // g:c1 // g], m[:, c0 // g:c1 // g], dtype)
                    out.addmm_(xd[:, c0:c1], wb.t())
                return out

        return Candidate(fn, _nbytes(packed, s, m), q4.dequantize())

    return build


def _deq_mm(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x @ _dequant_rows(packed, s, m, torch.float32).t()


def _deq_gemv(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # written as a reduction so that Inductor fuses dequantization into the dot products (no fp32 weight in memory)
    return (x[:, None, :] * _dequant_rows(packed, s, m, torch.float32)[None]).sum(-1)


def compiled(form: str) -> Callable[[torch.Tensor, Quant4], Candidate]:
    """``torch.compile`` (Inductor's C++ backend) of dequant + matmul (``mm``) or of a fused reduction (``gemv``).

    Dynamo's automatic dynamic shapes compile each weight shape twice (one row, then any M); the
    first call at each M pays the compile, which the harness records apart and excludes from the timings.
    The ``gemv`` form is measured up to 16 rows only: without a blocked GEMM it is no candidate for prefill.
    """

    def build(w: torch.Tensor, q4: Quant4) -> Candidate:
        packed, s, m = _q4_storage(q4)
        # one code object for every shape: raise dynamo's per-code recompile limit (default 8)
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        fn_c = torch.compile(_deq_mm if form == "mm" else _deq_gemv)
        return Candidate(lambda x: fn_c(x, packed, s, m),
                         _nbytes(packed, s, m), q4.dequantize(), max_rows=None if form == "mm" else 16)

    return build
