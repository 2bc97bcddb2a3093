"""Triton helpers that read a W4A16 GEMM's output, reduced or still as split-K partials (``split_k.py``).

:func:`sum_split_k` is the one definition of the split-K sum: the GEMM's reduction kernel and every op
that takes :class:`~.split_k.SplitKPartials` (norms, SiLU, RoPE + KV store) call it, so they agree bit
for bit. :func:`load_input` is how those ops load their input either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_split_k(row_ptr, bias_ptr, offs, mask, stride_split, num_splits, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """The output ``y[row, offs]`` from split-K partials at ``row_ptr + s * stride_split + offs``: splits summed
    in order in fp32, plus ``bias[offs]``, rounded to ``dtype``."""
    acc = tl.load(row_ptr + offs, mask=mask, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(row_ptr + s * stride_split + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return acc.to(dtype)


@triton.jit
def load_input(x_ptr, xb_ptr, offs, mask, stride_split, num_splits, SPLITS: tl.constexpr, SPLIT_BIAS: tl.constexpr,
               dtype: tl.constexpr):
    """A row slice of an op's input: loaded, or (``SPLITS``) a GEMM's split-K partials at
    ``x_ptr + s * stride_split`` summed by :func:`sum_split_k`, as the reduction kernel would have. The
    launcher passes ``(xb_ptr, stride_split, num_splits)`` and the constexprs from ``split_k.split_k_args``."""
    if SPLITS:
        x = sum_split_k(x_ptr, xb_ptr, offs, mask, stride_split, num_splits, SPLIT_BIAS, dtype)  # offs: columns
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return x
