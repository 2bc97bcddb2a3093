"""RTN: round-to-nearest W4 group quantization, the baseline AWQ is measured against.

Each linear weight is quantized on its own with its group's full min/max range (no scales,
no clipping, no calibration data), into the same AutoAWQ "gemm" format as AWQ.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from lightinfer.models.awq_tables import AwqTable
from lightinfer.quant.primitives import check_finite, quantize_linear_weight


def quantize_layer_rtn(
    get_tensor: Callable[[str], torch.Tensor],
    names: list[str],
    table: AwqTable,
    prefix: str,
    group_size: int,
    device: torch.device,
    keep_fp: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Quantize one decoder layer's linears, streamed tensor by tensor.

    Args:
        get_tensor: checkpoint reader (name -> tensor).
        names: the checkpoint's tensor names under ``prefix + "."``.
        prefix: ``model.layers.{i}``.
        keep_fp: linears of the table left in full precision (``modules_to_not_convert``).
    Returns:
        checkpoint name -> CPU tensor: ``.qweight/.qzeros/.scales`` for each linear of the
        table, everything else (norms, biases) in fp16.
    Raises:
        ValueError: NaN/inf in a weight, naming it; a linear of the table missing.
    """
    quantized = {f"{prefix}.{lin}.weight" for lin in table.linears if lin not in keep_fp}
    if table.moe is not None:  # every expert projection and the shared expert's linears
        moe = table.moe
        expert = re.compile(rf"{re.escape(prefix)}\.{re.escape(moe.block)}\.experts\.\d+\."
                            rf"({'|'.join(map(re.escape, moe.proj_names))})\.weight$")
        quantized |= {n for n in names if expert.match(n)}
        quantized |= {f"{prefix}.{p}.weight" for p in moe.shared_linears()}
    missing = sorted(quantized - set(names))
    if missing:
        raise ValueError(f"checkpoint lacks {missing[0]} (expected by the quantization table)")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        t = get_tensor(name)
        if name in quantized:
            base = name[: -len(".weight")]
            for k, v in quantize_linear_weight(t.to(device, torch.float32), group_size, name).items():
                out[f"{base}.{k}"] = v
        else:
            check_finite(t, name)
            out[name] = t.to("cpu", torch.float16)
    return out
