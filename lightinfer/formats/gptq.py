"""GPTQ checkpoints (GPTQModel, AutoGPTQ, optimum) -> lightinfer's W4 / W8 run-time layouts, once at load.

On disk, per linear (``../shared/DESIGN.md``, "Formats people already have")::

    qweight  int32 [K / (32/b), N]   packed along K, low bits first
    qzeros   int32 [K / G, N / (32/b)] packed along N
    scales   fp16  [K / G, N]
    g_idx    int32 [K]               group of each input channel (act-order when not k // G)
    w[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

``checkpoint_format`` "gptq" (v1) stores every zero minus one. GPTQModel reads v1 by adding one to
each packed field of the int32 word (``qzeros + 0x11111111`` for 4 bits), carries included; so does
this reader, which makes a v1 file read back exactly as the tool that wrote it reads it.

Act-order (``desc_act``): K is reordered at load by a stable sort of ``g_idx``, so each group's
channels are contiguous and the run-time layout (groups of consecutive K) holds them; the layer then
gathers its input in that order (``input_perm``), once per call, where q/k/v (and gate/up) share one
order and so one gather after fusion. That is what exllama and vLLM's GPTQ-Marlin do; the alternative,
a per-channel group lookup inside the GEMM, would cost a scale gather per weight instead of one
activation gather per token.
"""

from __future__ import annotations

import torch

from lightinfer.formats.packing import check_finite, expand_groups, group_order, unpack_int32
from lightinfer.formats.quant_config import GPTQSpec
from lightinfer.kernels import pack_int4_rows

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
V1_ZERO_OFFSET = {4: 0x11111111, 8: 0x01010101}  # +1 in every packed field of an int32 word


def check_gptq_tensors(parts: dict[str, torch.Tensor], spec: GPTQSpec, layer: str, file: object) -> tuple[int, int]:
    """Shapes, dtypes, finite scales and the ``g_idx`` of one GPTQ layer, before any conversion.

    Returns:
        ``(K, N)``.
    Raises:
        ValueError: naming the file and tensor (a wrong layout, e.g. AWQ tensors under a GPTQ config;
            NaN/inf scales; a ``g_idx`` that does not cover every group).
    """
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    per_word = 32 // spec.bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = scales.shape[0] if scales.dim() == 2 else 0
    if (qweight.dtype != torch.int32 or scales.dim() != 2 or scales.shape[1] != n or groups == 0 or k % groups
            or tuple(qzeros.shape) != (groups, -(-n // per_word))):
        raise ValueError(
            f"{file}: {layer}: qweight {tuple(qweight.shape)} {qweight.dtype}, qzeros {tuple(qzeros.shape)}, scales "
            f"{tuple(scales.shape)} are not a {spec.bits}-bit GPTQ layout (qweight int32 [in/{per_word}, out], qzeros "
            f"[in/G, out/{per_word}], scales [in/G, out]); does quantization_config.quant_method='gptq' / bits="
            f"{spec.bits} describe these tensors? (AutoAWQ stores qweight as [in, out/8])")
    if spec.group_size != -1 and k // groups != spec.group_size:
        raise ValueError(f"{file}: {layer}.scales has {groups} groups for {k} input channels, but "
                         f"quantization_config.group_size={spec.group_size}")
    check_finite(scales, f"{file}: {layer}.scales", layer)
    group_order(parts.get("g_idx"), k, groups, f"{file}: {layer}.g_idx")
    return k, n


def gptq_to_runtime(
    parts: dict[str, torch.Tensor], spec: GPTQSpec, runtime_group: int, dtype: torch.dtype, layer: str, file: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One GPTQ layer -> ``(qweight, scales, zeros, input_perm)`` in the W4 or W8 run-time layout.

    Args:
        parts: ``qweight``, ``qzeros``, ``scales`` and optionally ``g_idx`` (module docstring).
        spec: the checkpoint's GPTQ settings.
        runtime_group: the layer's run-time group size (``LinearFormat.runtime_group_size``).
        dtype: the activation dtype (W4 scales/zeros; W8 keeps fp32).
    Returns:
        4-bit: qweight int32 ``[N, K // 8]``, scales and zeros ``[K // G, N]`` in ``dtype``.
        8-bit: qweight int8 ``[N, K]`` (codes minus 128), fp32 scales, fp32 zeros (minus 128) or None
        when symmetric. ``input_perm`` int64 ``[K]`` for act-order, else None.
    Raises:
        ValueError: see :func:`check_gptq_tensors`; a symmetric 8-bit checkpoint whose zeros are not 128.
    """
    k, n = check_gptq_tensors(parts, spec, layer, file)
    bits = spec.bits
    qzeros = parts["qzeros"].to(torch.int32)
    if spec.checkpoint_format == "gptq":
        qzeros = qzeros + V1_ZERO_OFFSET[bits]  # int32 arithmetic wraps like GPTQModel's in-place add
    scales = parts["scales"]
    groups = scales.shape[0]
    codes = unpack_int32(parts["qweight"], bits, 0, k)  # [K, N]
    zeros = unpack_int32(qzeros, bits, 1, n)  # [groups, N]
    perm = group_order(parts.get("g_idx"), k, groups, f"{file}: {layer}.g_idx")
    if perm is not None:
        codes = codes.index_select(0, perm)
    factor = (k // groups) // runtime_group
    scales, zeros = expand_groups(scales, factor), expand_groups(zeros, factor)
    if bits == 4:
        return (pack_int4_rows(codes.t().contiguous()), scales.to(dtype).contiguous(),
                zeros.to(dtype).contiguous(), perm)
    zeros = zeros - 128
    if spec.sym:
        if bool((zeros != 0).any()):
            raise ValueError(f"{file}: {layer}.qzeros: quantization_config.sym=true but the zero points are not "
                             f"all 128; the checkpoint contradicts its config")
        zeros_out = None
    else:
        zeros_out = zeros.to(torch.float32).contiguous()
    return ((codes.t() - 128).to(torch.int8).contiguous(), scales.to(torch.float32).contiguous(), zeros_out, perm)
