"""Which run-time layout each linear layer of a checkpoint gets, and the check of a
``quantization_config`` before anything is loaded.

A checkpoint's linears run in one of three layouts:

* ``w4``: 4-bit codes, the W4A16 kernels (``kernels/reference.py``: qweight int32 ``[N, K // 8]``,
  scales/zeros ``[K // G, N]``). AWQ, 4-bit GPTQ, 4-bit compressed-tensors, GGUF Q4_0/Q4_1/Q4_K.
* ``w8``: int8 codes, the W8A16 kernel (``kernels/w8a16_gemm.py``). 8-bit GPTQ / compressed-tensors,
  GGUF Q8_0/Q6_K/Q5_*.
* ``dense``: the activation dtype (F16/BF16/F32 tensors, ``ignore`` / ``modules_to_not_convert``).

:class:`~lightinfer.loader.Checkpoint` decides per module from the tensors on disk and stores the map
in its ``quant_config`` under :data:`LINEAR_FORMATS_KEY`; :func:`linear_format` is what
``make_linear`` asks. A plain ``quantization_config`` without the map (dummy weights) keeps the
AutoAWQ rules (``group_size``, ``modules_to_not_convert``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LINEAR_FORMATS_KEY = "_lightinfer_linear_formats"
W4_KERNEL_GROUP_SIZES = (128, 64, 32)  # what the W4A16 kernels take (kernels/w4a16_gemm.py)


@dataclass(frozen=True)
class LinearFormat:
    """How one linear layer is stored on disk and run.

    Attributes:
        kind: ``"w4"``, ``"w8"`` or ``"dense"``.
        group_size: input channels per scale on disk; -1 = one group per output channel (the whole
            K); 0 for dense.
        symmetric: zero points are the codes' midpoint (W8 then keeps no zeros tensor).
        source: what the user would call it: ``"AWQ"``, ``"GPTQ"``, ``"compressed-tensors"``,
            ``"GGUF Q4_K"``, ``"F16"``...
        act_order: the checkpoint may carry a ``g_idx`` (GPTQ ``desc_act``, compressed-tensors
            ``actorder: group``): K is reordered at load and the input permuted at run time.
    """

    kind: str
    group_size: int = 0
    symmetric: bool = False
    source: str = ""
    act_order: bool = False

    def runtime_group_size(self, in_features: int) -> int:
        """The group size of the run-time layout for a layer with ``in_features`` (K).

        W4: the W4 kernels take G in 32/64/128, so a per-channel (-1) or larger group is stored as
        repeated groups of the largest of those dividing it (exact: the same scale repeated). W8 and
        groups the kernels take as they are: unchanged (-1 -> K).
        """
        g = in_features if self.group_size in (-1, 0) else self.group_size
        if self.kind == "w4" and g not in W4_KERNEL_GROUP_SIZES:
            return next((s for s in W4_KERNEL_GROUP_SIZES if g % s == 0 and in_features % s == 0), g)
        return g

    def describe(self) -> str:
        """A short text for the start-up summary and ``model_info()``: ``"W4 (GPTQ, g128, act-order)"``."""
        if self.kind == "dense":
            return f"dense ({self.source})" if self.source else "dense"
        g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = ", act-order" if self.act_order else ""
        return f"{self.kind.upper()} ({self.source}, {g}{extra})"


DENSE = LinearFormat("dense")


def _awq_skips(quant_config: dict, prefix: str) -> bool:
    skip = quant_config.get("modules_to_not_convert") or []
    return any(prefix == m or prefix.startswith(m + ".") or prefix.endswith("." + m) or m in prefix.split(".")
               for m in skip)


def linear_format(quant_config: dict | None, prefix: str) -> LinearFormat:
    """The layout of the linear layer named ``prefix`` (e.g. ``model.layers.0.self_attn.q_proj``).

    Args:
        quant_config: a checkpoint's ``quantization_config`` (with :data:`LINEAR_FORMATS_KEY` when a
            :class:`~lightinfer.loader.Checkpoint` made it), or None for a dense model.
    """
    if quant_config is None:
        return DENSE
    per_module = quant_config.get(LINEAR_FORMATS_KEY)
    if per_module is not None:
        return per_module.get(prefix, DENSE)
    if _awq_skips(quant_config, prefix):
        return DENSE
    method = str(quant_config.get("quant_method", "awq")).lower()
    bits = int(quant_config.get("bits", 4))
    return LinearFormat("w4" if bits == 4 else "w8", int(quant_config["group_size"]), False, method.upper())


def describe_formats(formats: dict[str, LinearFormat | str]) -> dict[str, str]:
    """Per layer kind (the last part of the module name: ``q_proj``, ``down_proj``, ``embed_tokens``...)
    how it is loaded, e.g. ``{"q_proj": "W4 (GGUF Q4_1, g32)", "lm_head": "W8 (GGUF Q8_0, g32)"}``;
    kinds loaded several ways list each with its count (``"W4 (GGUF Q4_K, g32) x24; W8 (...) x6"``)."""
    by_kind: dict[str, dict[str, int]] = {}
    for name, fmt in formats.items():
        text = fmt.describe() if isinstance(fmt, LinearFormat) else str(fmt)
        counts = by_kind.setdefault(name.rsplit(".", 1)[-1], {})
        counts[text] = counts.get(text, 0) + 1
    return {kind: texts.popitem()[0] if len(texts) == 1 else "; ".join(f"{t} x{n}" for t, n in texts.items())
            for kind, texts in sorted(by_kind.items())}


def largest_kernel_group(k: int) -> int | None:
    """The largest W4 kernel group size dividing ``k``, or None."""
    return next((g for g in W4_KERNEL_GROUP_SIZES if k % g == 0), None)


def check_group_size(group_size: object, in_features: dict[str, int], bits: int, where: str) -> None:
    """Refuse a group size the run-time layouts cannot hold, naming it and the layers.

    W4 needs the group (or the whole K for -1) to be a multiple of 32; W8 any divisor of K.

    Raises:
        ValueError: a non-integer, a zero or negative other than -1, a size that does not divide a
            layer's input, or (4-bit) a group below 32 or not a multiple of 32.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{where}: group_size={group_size!r} must be a positive integer or -1 (per channel)")
    if group_size == -1:
        bad = {n: k for n, k in in_features.items() if bits == 4 and largest_kernel_group(k) is None}
    else:
        bad = {n: k for n, k in in_features.items() if k % group_size}
        if bits == 4 and (group_size < 32 or group_size % 32):
            raise ValueError(f"{where}: group_size={group_size} is not supported for 4-bit weights: the W4 kernels "
                             f"take groups of 32, 64, 128 (or a multiple of 32, stored as repeated groups)")
    if bad:
        raise ValueError(f"{where}: group_size={group_size} does not fit the input size of "
                         f"{', '.join(f'{n}={k}' for n, k in bad.items())}")


def pack_factor(bits: int) -> int:
    """Codes per int32 word."""
    return 32 // bits


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
