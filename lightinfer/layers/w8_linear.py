"""``W8A16Linear``: int8 weight codes with a scale (and optional zero) per group, 16-bit activations.

It runs what a checkpoint stores with more than 4 bits without widening it to fp16: GGUF Q8_0 /
Q6_K / Q5_* tensors (a Q4_K_M file's Q6_K layers, SmolLM2's Q8_0 embedding and LM head) and 8-bit
GPTQ / compressed-tensors. Layout: ``kernels/reference.py`` ("W8A16"): qweight int8 ``[out, in]``,
fp32 scales and zeros ``[in // G, out]``. 1.125 bytes per weight at G = 32 (symmetric) against 2 for
fp16, with the file's own values: the codes are the file's, and fp32 holds every GGUF scale exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.kernels import dequantize_w8, prepare_w8_cpu, prepare_w8_per_channel_cpu
from lightinfer.layers.cpu_gemm import use_cpu_lowbit
from lightinfer.layers.weight_forms import (
    LinearWeight,
    W8RuntimeWeight,
    check_runtime_tensors,
    dense_weight_form,
    lowbit_weight,
)

__all__ = ["W8A16Linear", "check_runtime_tensors", "inverse_permutation"]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[j]] = j`` (int64, same device)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


class W8A16Linear(nn.Module):
    """``y = x W^T + b`` with ``W[n, k] = (q[n, k] - z[k // G, n]) * s[k // G, n]``, q int8.

    Args:
        in_features, out_features: K and N.
        bias: whether the layer has a bias (in ``dtype``).
        group_size: G, a divisor of K (K itself: one scale per output channel).
        dtype: the activation dtype (and the bias's). Scales and zeros are always fp32.
        symmetric: no zeros tensor (every zero is 0).

    Attributes:
        input_perm: None, or int64 ``[K]``: the stored K order is ``x[..., input_perm]`` (act-order
            checkpoints, whose groups become contiguous only after reordering K). The GPU path
            gathers the input once per call; the CPU path un-permutes its dense copy instead.

    Raises:
        ValueError: ``group_size`` does not divide ``in_features``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int, dtype: torch.dtype,
                 symmetric: bool = True) -> None:
        super().__init__()
        if group_size <= 0 or in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        num_groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(num_groups, out_features, dtype=torch.float32))
        self.register_buffer("zeros", None if symmetric else torch.zeros(num_groups, out_features,
                                                                           dtype=torch.float32))
        self.register_buffer("input_perm", None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.dtype = dtype
        # the weight's form (layers/weight_forms.py): the run-time tensors through the op backend, until
        # pack_for_cpu picks the CPU engine's form (two int4 halves, per-row int8 for an LM head, or dequantized)
        self.weight_impl: LinearWeight = W8RuntimeWeight(self)
        self.rows_read = False  # an embedding reads rows of this table: pack_for_cpu keeps the int8 tensors
        self.lm_head = False  # an LM head multiplies by this table (QuantizedLMHead sets it)

    @torch.no_grad()
    def load_runtime(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     input_perm: torch.Tensor | None = None) -> None:
        """Take tensors already in the W8 run-time layout (``lightinfer.formats`` converts them).

        Raises:
            ValueError: shapes or dtypes that do not match this layer, or zeros on a symmetric layer.
        """
        want_q = (self.out_features, self.in_features)
        if qweight.dtype != torch.int8 or tuple(qweight.shape) != want_q or tuple(scales.shape) != tuple(
                self.scales.shape):
            raise ValueError(f"W8 tensors qweight {tuple(qweight.shape)} {qweight.dtype} / scales "
                             f"{tuple(scales.shape)} do not match a {self.in_features}->{self.out_features} layer "
                             f"with group_size {self.group_size} (expected int8 {want_q}, scales "
                             f"{tuple(self.scales.shape)})")
        if (zeros is None) != (self.zeros is None):
            raise ValueError("W8 zeros given for a symmetric layer (or missing for an asymmetric one)")
        self.qweight.copy_(qweight)
        self.scales.copy_(scales.to(torch.float32))
        if zeros is not None:
            self.zeros.copy_(zeros.to(torch.float32))
        self.input_perm = None if input_perm is None else input_perm.to(self.qweight.device, torch.int64)
        self.weight_impl = W8RuntimeWeight(self)  # new tensors: any prepared form is stale

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` in the original input order, dequantized in fp32.

        Raises:
            RuntimeError: the int8 tensors were released for the CPU engine (:meth:`pack_for_cpu`).
        """
        check_runtime_tensors(self)
        w = dequantize_w8(self.qweight, self.scales, self.zeros)
        if self.input_perm is not None:
            w = w.index_select(1, inverse_permutation(self.input_perm))
        return w

    def pack_for_cpu(self) -> None:
        """Prepare the weight once for the CPU GEMM, choosing its form (``layers/weight_forms.py``), as
        ``W4A16Linear`` does. With 16-bit activations it stays 8-bit: an LM head's table is requantized to one
        int8 scale per row for the int8 GEMM (``kernels.prepare_w8_per_channel_cpu``, ``Int8PerChannelWeight``:
        the largest product of a step, 1.2-2.8x faster than the halves, module docstring of
        ``kernels/cpu_lowbit.py``); any other layer becomes two exact 4-bit halves in torch's int4 GEMM layout
        (``kernels.prepare_w8_cpu``, ``TorchInt4Weight``). The prepared form replaces the int8 tensors, except in
        a table an embedding reads (``rows_read``: a tied Q8_0 embedding / LM head), which keeps them and
        dequantizes the rows it is asked for: the file's values. With fp32 activations (or a shape those kernels
        cannot take) the weight is dequantized once, in the activation dtype, and prepacked
        (``PackedDenseWeight``, or ``DequantizedWeight``). An LM head's forms give fp32 logits. No-op on CUDA."""
        if self.qweight is None or self.qweight.is_cuda or self.weight_impl.cpu_prepared:
            return  # (a tied table is reached twice: as the embedding's and as the LM head's)
        # an LM head's logits in fp32: rounded to bf16 (steps of 0.125 at 16-32) near-equal tokens tie, and the
        # greedy pick falls to the lower id (SmolLM2 answered 'L'Étoile...' to the README's question)
        out_dtype = torch.float32 if self.lm_head else None
        form, runtime = None, W8RuntimeWeight(self)  # runtime: where another backend is forced (weight_forms)
        if use_cpu_lowbit(self.dtype):
            if self.lm_head:
                form = lowbit_weight(prepare_w8_per_channel_cpu(self.qweight, self.scales, self.zeros,
                                                                self.input_perm), out_dtype, runtime)
            if form is None and self.rows_read and not self.lm_head:
                return  # only read as rows (an untied embedding): nothing multiplies by it
            if form is None:
                form = lowbit_weight(prepare_w8_cpu(self.qweight, self.scales, self.zeros, self.input_perm),
                                     out_dtype, runtime)
        if form is None:
            self.weight_impl = dense_weight_form(self.dense_weight().to(self.dtype), runtime)
            return
        form.bind_bias(self.bias)
        self.weight_impl = form
        if not self.rows_read:
            self.qweight = self.scales = self.zeros = None  # the same codes in another layout: one copy

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of the weight ``[T, in]`` (the embedding's lookup), dequantized from the
        int8 tensors in fp32 (which ``pack_for_cpu`` keeps in a table an embedding reads).

        Raises:
            RuntimeError: the int8 tensors were released (the table was packed before the embedding took it).
        """
        check_runtime_tensors(self)
        zeros = None if self.zeros is None else self.zeros.index_select(1, ids)
        return dequantize_w8(self.qweight.index_select(0, ids), self.scales.index_select(1, ids), zeros)

    @property
    def device(self) -> torch.device:
        """Where the weight lives (its int8 codes, or the form the CPU engine prepared)."""
        if self.qweight is not None:
            return self.qweight.device
        return self.weight_impl.tensors()[0].device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` (fp32 accumulation), by the weight's form (``weight_impl``): the one
        :meth:`pack_for_cpu` chose on a CPU engine, else the op over the int8 run-time tensors on ``triton`` /
        ``reference`` (as ``W4A16Linear``; a layer used unprepared on ``torch_cpu`` dequantizes once)."""
        return self.weight_impl.forward(x, self.bias)
