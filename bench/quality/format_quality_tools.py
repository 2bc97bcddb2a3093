"""The third-party half of ``bench/quality/format_quality.py``: run with the tools' venv python, never the project's.

It writes checkpoints with the real tools and computes each checkpoint's reference perplexity: the tool's
own dequantization, run dense in fp32 by transformers (``format_ref.score_dense``, the windows lightinfer
scores). The tools (GPTQModel 7.5.0, compressed-tensors 0.20.1 on the CPU torch 2.13) live in the venv
``tests/fixtures/make_quant_fixtures.py`` describes; the main script finds it and calls::

    <venv>/bin/python bench/quality/format_quality_tools.py gptq --base DIR --out DIR --ids IDS [--sym] [--desc-act]
    <venv>/bin/python bench/quality/format_quality_tools.py ct   --base DIR --out DIR --ids IDS --strategy group|channel [--sym]
    <venv>/bin/python bench/quality/format_quality_tools.py ref  --out DIR --ids IDS     (an existing checkpoint)

``IDS`` is the JSON the main script writes: the held-out ``ids``, the ``window``, and ``calib`` (token id
lists from the calibration half of the text, for GPTQ). Each command writes ``DIR/reference_ppl.json``.
The reference dequantizers: GPTQModel's ``dequantize_weight`` (its loaded modules), compressed-tensors'
``PackedQuantizationCompressor`` (pack-quantized), and GPTQModel's port of AutoAWQ's ``dequantize_gemm``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests" / "fixtures")]  # a file run in that venv: no bench package

from format_ref import dense_model, read_ids, score_dense


def quantize_gptq(base: Path, out: Path, calib: list[list[int]], sym: bool, desc_act: bool, group_size: int) -> None:
    """GPTQModel's GPTQ (CPU) of ``base`` into ``out`` (checkpoint_format "gptq", 4-bit)."""
    from gptqmodel import GPTQModel, QuantizeConfig

    qcfg = QuantizeConfig(bits=4, group_size=group_size, sym=sym, desc_act=desc_act, format="gptq",
                          act_group_aware=not desc_act)
    model = GPTQModel.load(str(base), qcfg, device="cpu")
    model.quantize([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calib], batch_size=4)
    model.save(str(out))


def quantize_ct(base: Path, out: Path, strategy: str, sym: bool, group_size: int) -> None:
    """compressed-tensors' own min-max calibration and pack-quantized compressor (the fixtures' recipe)."""
    from make_quant_fixtures import make_ct

    s = {"num_bits": 4, "strategy": strategy, "symmetric": sym, "layers": 30}
    if strategy == "group":
        s["group_size"] = group_size
    make_ct(base, out, s)


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        if f.name == "reference.safetensors":
            continue
        with safe_open(str(f), framework="pt") as h:
            state.update({n: h.get_tensor(n) for n in h.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return state


def dequantized_state(out: Path) -> dict[str, torch.Tensor]:
    """Every weight of checkpoint ``out`` as its own tool dequantizes it (fp32), the rest as stored."""
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    state = _tensors(out)
    if method == "gptq":
        from gptqmodel import GPTQModel

        loaded = GPTQModel.load(str(out), device="cpu", dtype=torch.float32)
        dense = {f"{n}.weight": m.dequantize_weight().t().float()  # its dequantizer gives [in, out]
                 for n, m in loaded.model.named_modules() if hasattr(m, "dequantize_weight") and hasattr(m, "qweight")}
        suffixes = (".qweight", ".qzeros", ".scales", ".g_idx")
    elif method == "compressed-tensors":
        from make_quant_fixtures import _ct_decompress

        weights = next(iter(qc["config_groups"].values()))["weights"]
        dense = {}
        for n in [n for n in state if n.endswith(".weight_packed")]:
            base = n[: -len(".weight_packed")]
            sd = {k[len(base) + 1:]: v for k, v in state.items() if k.startswith(base + ".")}
            dense[f"{base}.weight"] = _ct_decompress(sd, weights).float()
        suffixes = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")
    elif method == "awq":
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

        dense = {}
        for n in [n for n in state if n.endswith(".qweight")]:
            base = n[: -len(".qweight")]
            w = dequantize_gemm(state[n], state[f"{base}.qzeros"], state[f"{base}.scales"].float(), qc["bits"],
                                qc["group_size"])  # [in, out]
            dense[f"{base}.weight"] = w.t().float()
        suffixes = (".qweight", ".qzeros", ".scales")
    else:
        raise SystemExit(f"{out}: quant_method {method!r} has no reference dequantizer here")
    kept = {n: t for n, t in state.items() if not n.endswith(suffixes)}
    return kept | dense


def reference(out: Path, ids_file: Path) -> dict:
    """Score ``out``'s dequantized weights dense in fp32; write and return ``out/reference_ppl.json``."""
    import transformers

    ids, window = read_ids(ids_file)[:2]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = dense_model(transformers.AutoConfig.from_pretrained(out), dequantized_state(out))
    res = score_dense(model, ids, window)
    (out / "reference_ppl.json").write_text(json.dumps(res) + "\n")
    print(f"reference {out.name}: ppl {res['ppl']:.4f} over {res['tokens_scored']} tokens ({res['seconds']} s)")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["gptq", "ct", "ref"])
    p.add_argument("--base", type=Path, help="the fp32 Hugging Face folder to quantize")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ids", type=Path, required=True)
    p.add_argument("--sym", action="store_true")
    p.add_argument("--desc-act", action="store_true")
    p.add_argument("--strategy", default="group", choices=["group", "channel"])
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args()
    if a.command == "gptq":
        quantize_gptq(a.base, a.out, json.loads(a.ids.read_text())["calib"], a.sym, a.desc_act, a.group_size)
    elif a.command == "ct":
        quantize_ct(a.base, a.out, a.strategy, a.sym, a.group_size)
    reference(a.out, a.ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
