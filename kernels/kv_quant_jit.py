"""INT8 KV quantization inside a Triton kernel: the in-register twin of ``reference.quantize_kv_int8``.

Per token and head (a row), asymmetric, bit-identical to the reference::

    scale = fp16((max - min) / 255)  (1 where max == min)
    zero  = fp16(min + 128 * scale)
    q     = clamp(round_half_even((x - zero) / scale), -128, 127)

The KV store (``kv_store.py``) and the fused RoPE + KV store (``rope_store.py``) both call
:func:`quantize_rows`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(y):
    """fp32 ``y`` (``|y| < 2^22``) rounded to the nearest integer, ties to even, like ``torch.round``."""
    # Adding and subtracting 1.5 * 2^23 rounds to an integer in the FPU's mode (ties to even); the
    # interpreter lacks libdevice.rint.
    return (y + 12582912.0) - 12582912.0


@triton.jit
def quantize_rows(x, mask):
    """x fp32 [BLOCK_H, BLOCK_D] (masked lanes ignored) -> (q fp32 codes, scale fp32, zero fp32) per row."""
    lo = tl.min(tl.where(mask, x, float("inf")), axis=1)
    hi = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    scale = tl.math.div_rn(hi - lo, 255.0)
    scale = tl.where(scale > 0, scale, 1.0)
    scale = scale.to(tl.float16).to(tl.float32)  # quantize against the value that is stored
    zero = (lo + 128.0 * scale).to(tl.float16).to(tl.float32)
    q = round_half_even(tl.math.div_rn(x - zero[:, None], scale[:, None]))
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    return q, scale, zero
