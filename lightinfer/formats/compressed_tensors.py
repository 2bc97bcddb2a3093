"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor) -> W4 / W8 run-time layouts, at load.

On disk, per quantized linear (b = num_bits, 4 or 8; codes signed, stored plus ``2^(b-1)``)::

    weight_packed      int32 [N, K * b / 32]     packed along K, low bits first
    weight_scale       float [N, K / G]           ([N, 1] for strategy "channel")
    weight_zero_point  int32 [N * b / 32, K / G]  asymmetric only; packed along N (dim 0)
    weight_shape       int   [2] = (N, K)
    weight_g_idx       int   [K]                  actorder "group" only
    w[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)]

With the stored (unsigned) codes ``u = q + 2^(b-1)`` and stored zero ``v = zp + 2^(b-1)`` that is
``(u - v) * scale``: 4-bit codes and zeros go straight into the W4 layout (zero 8 when symmetric),
8-bit ones into W8 as signed ``q`` and ``zp``. ``weight_g_idx`` reorders K like GPTQ's act-order
(``lightinfer.formats.gptq``).
"""

from __future__ import annotations

import torch

from lightinfer.formats.packing import check_finite, expand_groups, group_order, unpack_int32
from lightinfer.formats.quant_config import CTScheme
from lightinfer.kernels import pack_int4_rows

CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def check_ct_tensors(parts: dict[str, torch.Tensor], scheme: CTScheme, layer: str, file: object) -> tuple[int, int]:
    """Shapes, dtypes, finite scales and ``weight_g_idx`` of one layer. Returns ``(K, N)``.

    Raises:
        ValueError: naming the file and tensor.
    """
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    shape = parts.get("weight_shape")
    bits = scheme.num_bits
    if shape is None or shape.numel() != 2:
        raise ValueError(f"{file}: {layer}.weight_shape is missing or not (out, in)")
    n, k = (int(v) for v in shape.tolist())
    per_word = 32 // bits
    groups = 1 if scheme.strategy == "channel" else (k // scheme.group_size if scheme.group_size else 0)
    if (packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // per_word)) or k % per_word
            or tuple(scale.shape) != (n, groups)):
        raise ValueError(f"{file}: {layer}: weight_packed {tuple(packed.shape)} {packed.dtype} / weight_scale "
                         f"{tuple(scale.shape)} do not match weight_shape ({n}, {k}) with {bits}-bit "
                         f"{scheme.strategy} quantization (expected int32 ({n}, {k // per_word}) and ({n}, {groups}))")
    if not scheme.symmetric:
        zp = parts.get("weight_zero_point")
        if zp is None or tuple(zp.shape) != (-(-n // per_word), groups):
            raise ValueError(f"{file}: {layer}.weight_zero_point is missing or not ({-(-n // per_word)}, {groups}) "
                             f"(asymmetric {bits}-bit zero points packed along the output dimension)")
    check_finite(scale, f"{file}: {layer}.weight_scale", layer)
    group_order(parts.get("weight_g_idx"), k, groups, f"{file}: {layer}.weight_g_idx")
    return k, n


def ct_to_runtime(
    parts: dict[str, torch.Tensor], scheme: CTScheme, runtime_group: int, dtype: torch.dtype, layer: str, file: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One layer -> ``(qweight, scales, zeros, input_perm)`` in the W4 (4-bit) or W8 (8-bit) layout.

    Returns:
        As :func:`lightinfer.formats.gptq.gptq_to_runtime`.
    Raises:
        ValueError: see :func:`check_ct_tensors`.
    """
    k, n = check_ct_tensors(parts, scheme, layer, file)
    bits, offset = scheme.num_bits, 1 << (scheme.num_bits - 1)
    scale = parts["weight_scale"].t()  # [groups, N]
    groups = scale.shape[0]
    codes = unpack_int32(parts["weight_packed"], bits, 1, k)  # [N, K], stored (unsigned)
    if scheme.symmetric:
        zeros = torch.full((groups, n), offset, dtype=torch.int32)
    else:
        zeros = unpack_int32(parts["weight_zero_point"], bits, 0, n).t()  # [groups, N], stored (unsigned)
    perm = group_order(parts.get("weight_g_idx"), k, groups, f"{file}: {layer}.weight_g_idx")
    if perm is not None:
        codes = codes.index_select(1, perm)
    factor = (k // groups) // runtime_group
    scale, zeros = expand_groups(scale, factor), expand_groups(zeros, factor)
    if bits == 4:
        return pack_int4_rows(codes.contiguous()), scale.to(dtype).contiguous(), zeros.to(dtype).contiguous(), perm
    zeros_out = None if scheme.symmetric else (zeros - offset).to(torch.float32).contiguous()
    return (codes - offset).to(torch.int8).contiguous(), scale.to(torch.float32).contiguous(), zeros_out, perm
