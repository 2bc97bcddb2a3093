"""AutoAWQ "gemm" tensors (what ``lightinfer quantize`` computes) -> a compressed-tensors ``pack-quantized``
checkpoint, the format llm-compressor writes and vLLM / SGLang / transformers load natively.

The 4-bit codes, scales and integer zero points are the same numbers in another arrangement
(``lightinfer.formats.compressed_tensors`` documents the layout), so the conversion is exact:
``w = (q - z) * s`` with AWQ's code ``q`` and zero ``z`` in 0..15 is compressed-tensors' asymmetric
int4 ``(q_s - zp) * s`` with ``q_s = q - 8`` and ``zp = z - 8``, stored plus 8: the very same nibbles.
"""

from __future__ import annotations

import torch

from lightinfer.formats.packing import pack_int32
from lightinfer.kernels import pack_int4_rows, unpack_awq


def awq_to_compressed_tensors(tensors: dict[str, torch.Tensor], awq_config: dict) -> tuple[dict[str, torch.Tensor],
                                                                                           dict]:
    """Convert a checkpoint's tensors and ``quantization_config`` from AutoAWQ gemm to compressed-tensors.

    Args:
        tensors: name -> tensor; AWQ layers as ``qweight`` int32 ``[K, N // 8]``, ``qzeros`` int32
            ``[K // G, N // 8]``, ``scales`` fp16 ``[K // G, N]``; everything else is copied.
        awq_config: the AutoAWQ ``quantization_config`` (``bits`` 4, ``group_size``).
    Returns:
        ``(tensors, quantization_config)``: per layer ``weight_packed`` int32 ``[N, K // 8]``,
        ``weight_scale`` ``[N, K // G]``, ``weight_zero_point`` int32 ``[N // 8, K // G]``,
        ``weight_shape`` int64 ``[2]``; the linears left dense are listed in ``ignore`` by name.
    Raises:
        ValueError: a config other than 4-bit AWQ with zero points.
    """
    if awq_config.get("quant_method") != "awq" or awq_config.get("bits") != 4 or not awq_config.get("zero_point", True):
        raise ValueError(f"only 4-bit AWQ with zero points converts to compressed-tensors, got {awq_config}")
    out: dict[str, torch.Tensor] = {}
    quantized = {n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")}
    for name, t in tensors.items():
        base, _, leaf = name.rpartition(".")
        if base in quantized and leaf in ("qweight", "qzeros", "scales"):  # a bias (Qwen2's q/k/v) is copied
            if leaf == "qweight":
                codes = unpack_awq(t.to(torch.int32))  # [K, N]
                zeros = unpack_awq(tensors[f"{base}.qzeros"].to(torch.int32))  # [K // G, N]
                k, n = codes.shape
                out[f"{base}.weight_packed"] = pack_int4_rows(codes.t().contiguous())
                out[f"{base}.weight_scale"] = tensors[f"{base}.scales"].t().contiguous()
                out[f"{base}.weight_zero_point"] = pack_int32(zeros.t().contiguous(), 4, dim=0)
                out[f"{base}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            continue
        out[name] = t
    dense_linears = sorted(n[: -len(".weight")] for n, t in tensors.items()
                           if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n)
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                        "group_size": int(awq_config["group_size"]), "dynamic": False, "actorder": None,
                        "block_structure": None},
            "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
        "ignore": dense_linears or ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }
    return out, config
