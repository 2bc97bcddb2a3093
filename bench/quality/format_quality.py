"""Held-out perplexity of every checkpoint format lightinfer runs, each against ITS reference (issue 16).

The model is the embedded SmolLM2-135M-Instruct; the text the built-in held-out half (what
``lightinfer eval-ppl`` and ``bench/quality/quant_quality.py`` score). For each format:

  reference   the same checkpoint dequantized by the format's reference dequantizer and run dense in fp32
              by transformers (``bench/quality/format_ref.py``): transformers' GGUF reader; GPTQModel's
              ``dequantize_weight``; compressed-tensors' pack-quantized decompressor; AutoAWQ's
              ``dequantize_gemm`` (GPTQModel's port)
  float32     lightinfer, ``dtype="float32"``: the exact path (4-/8-bit codes dequantized once; the W4/W8
              kernels' arithmetic). The criterion: within 0.5% of the reference.
  auto        lightinfer, ``dtype="auto"`` on the CPU: bf16 activations, the weights kept 4-/8-bit (torch's
              int4 GEMM): what a CPU user gets by default. Reported beside it, not held to 0.5%.

Formats: GGUF Q4_1 (the embedded file) and Q4_0 / Q4_K (+ Q5_0 where rows are not whole super-blocks) /
Q8_0 files re-encoded from its weights (``bench/quality/format_gguf.py``); GPTQ written by GPTQModel 7.5.0 from
the fp32 weights (4-bit, g64, sym/asym, with and without desc_act: SmolLM2's hidden 576 is not a
multiple of 128, so g128 would leave a partial group, which lightinfer, like vLLM's kernels, refuses);
compressed-tensors pack-quantized written by the compressed-tensors library (group 64 / channel,
sym / asym) and by ``lightinfer quantize --format compressed-tensors``; AutoAWQ "gemm" written by
``lightinfer quantize --format awq``. lightinfer's own checkpoints use ``--method rtn`` by default
(the format is under test, not the search; ``--method awq`` to change).

The third-party tools run in their own venv (``--tools-venv``, the one ``tests/fixtures/make_quant_fixtures.py``
describes) through ``bench/quality/format_quality_tools.py``; without it, their formats are skipped with a message.

Usage: ``python -m bench.quality.format_quality [--max-tokens 2048] [--window 2048] [--only gguf-q4_1 ...] [--reuse]``
Writes ``bench/results/format_quality.{json,md}`` (after every format, so a crash keeps what was done).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.results import RESULTS, ROOT
from bench.quality.format_gguf import VARIANTS, gguf_reference_model, write_variant
from bench.quality.format_ref import score_dense
from bench.quality.quant_quality import MODEL, _ppl

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.005  # issue 16: held-out perplexity within 0.5% of the reference
GPTQ = {f"gptq-4bit-g64-{'sym' if s else 'asym'}{'-actorder' if d else ''}": (s, d)
        for d in (False, True) for s in (True, False)}
CT_LIB = {f"ct-lib-{st}{'-g64' if st == 'group' else ''}-{'sym' if s else 'asym'}": (st, s)
          for st in ("group", "channel") for s in (True, False)}
OURS = {"ct-lightinfer-g64-asym": "compressed-tensors", "awq-lightinfer-g64": "awq"}
# Ordered so that a cut-short run has one of each family first.
CASES = ["gguf-q4_1", "gptq-4bit-g64-asym-actorder", "ct-lib-group-g64-asym", "ct-lightinfer-g64-asym",
         "awq-lightinfer-g64", "gguf-q4_k", "gguf-q4_0", "gguf-q8_0", "gptq-4bit-g64-sym", "gptq-4bit-g64-asym",
         "gptq-4bit-g64-sym-actorder", "ct-lib-group-g64-sym", "ct-lib-channel-sym", "ct-lib-channel-asym"]
assert set(CASES) == {f"gguf-{v}" for v in ("q4_1", *VARIANTS)} | set(GPTQ) | set(CT_LIB) | set(OURS)


def _gguf_path() -> Path:
    from lightinfer.loader import resolve_model_path

    return Path(resolve_model_path(MODEL))


def prepare(work: Path, max_tokens: int | None, window: int, calib_n: int, calib_len: int) -> Path:
    """``work/ids.json``: the held-out ids lightinfer scores (its tokenizer, no special tokens, cut to
    ``max_tokens``), the window, and calibration ids from the other half of the text (GPTQ)."""
    from transformers import AutoTokenizer

    from lightinfer.quant.calib import get_text

    p = _gguf_path()
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    ids = tok(get_text(None, "eval"), add_special_tokens=False)["input_ids"][:max_tokens]
    cal = tok(get_text(None, "calib"), add_special_tokens=False)["input_ids"]
    calib = [cal[i * calib_len:(i + 1) * calib_len] for i in range(min(calib_n, len(cal) // calib_len))]
    work.mkdir(parents=True, exist_ok=True)
    (work / "ids.json").write_text(json.dumps({"ids": ids, "window": window, "calib": calib}))
    return work / "ids.json"


def base_folder(work: Path) -> Path:
    """The embedded GGUF dequantized to fp32 (transformers' reader) as a Hugging Face folder: the tools' input."""
    from transformers import AutoTokenizer

    base = work / "base-fp32"
    if not (base / "config.json").is_file():
        p = _gguf_path()
        gguf_reference_model(p).save_pretrained(base, safe_serialization=True)
        AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(base)
    return base


def tools(venv: Path, args: list[str]) -> None:
    """Run ``format_quality_tools.py`` with the tools' python (cwd: a scratch folder GPTQModel may litter)."""
    cwd = Path(args[args.index("--out") + 1]).parent / "tool-cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    # GPTQModel sizes its CPU thread pool from os.cpu_count(); on 2 cores its loader pool (2) exceeds it.
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": os.environ.get("GPTQMODEL_CPU_WORKERS", "2")}
    subprocess.run([str(venv / "bin" / "python"), str(HERE / "format_quality_tools.py"), *args], check=True, cwd=cwd,
                   env=env)


def make_case(name: str, work: Path, ids_file: Path, venv: Path | None, method: str, reuse: bool) -> tuple[Path, dict]:
    """Build case ``name``'s checkpoint (unless ``reuse`` finds it) and return (path, reference result)."""
    ids = json.loads(ids_file.read_text())
    if name.startswith("gguf-"):
        variant = name[len("gguf-"):]
        path = _gguf_path() if variant == "q4_1" else work / f"smollm2-{variant}.gguf"
        if variant != "q4_1" and not (reuse and path.is_file()):
            print(f"  {path.name}: {write_variant(_gguf_path(), path, variant)}", flush=True)
        ref_file = work / f"{name}.reference_ppl.json"
        if not (reuse and ref_file.is_file()):
            ref_file.write_text(json.dumps(score_dense(gguf_reference_model(path), ids["ids"], ids["window"])))
        return path, json.loads(ref_file.read_text())
    out = work / name
    done = reuse and (out / "reference_ppl.json").is_file()
    common = ["--out", str(out), "--ids", str(ids_file)]
    if name in OURS:
        if not done:
            from lightinfer.quant.api import quantize
            from lightinfer.quant.config import QuantConfig

            quantize(MODEL, out, QuantConfig(method=method, group_size=64, format=OURS[name]), force=True, progress=False)
            tools(venv, ["ref", *common])  # type: ignore[arg-type]
    elif not done:
        base = base_folder(work)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        if name in GPTQ:
            sym, act = GPTQ[name]
            tools(venv, ["gptq", "--base", str(base), *common, *(["--sym"] if sym else []),  # type: ignore[arg-type]
                         *(["--desc-act"] if act else [])])
        else:
            strategy, sym = CT_LIB[name]
            tools(venv, ["ct", "--base", str(base), *common, "--strategy", strategy,  # type: ignore[arg-type]
                         *(["--sym"] if sym else [])])
    return out, json.loads((out / "reference_ppl.json").read_text())


def write_results(res: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "format_quality.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [f"# Held-out perplexity per format vs its reference ({res['model']})", "",
             (f"The first {res['tokens']} held-out tokens, in windows of {res['window']}; reference = the format's own "
              "dequantizer, transformers fp32 dense. Pass = float32 path within 0.5% of the reference."), "",
             "| format | reference ppl | lightinfer float32 | delta | pass | lightinfer auto (bf16) | delta |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res["formats"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        f32, bf = r.get("float32", {}), r.get("auto", {})
        lines.append(f"| {name} | {r['reference']['ppl']:.4f} | {f32.get('ppl', float('nan')):.4f} | "
                     f"{f32.get('rel_diff', float('nan')):+.3%} | {'yes' if r.get('pass') else 'NO'} | "
                     f"{bf.get('ppl', float('nan')):.4f} | {bf.get('rel_diff', float('nan')):+.3%} |")
    (out_dir / "format_quality.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="score the first N held-out tokens (default 2048: one window; fits ~25 min on 2 shared cores)")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--only", nargs="+", choices=CASES, default=None, help="formats to measure (default: all)")
    ap.add_argument("--tools-venv", type=Path, default=Path(os.environ.get(
        "LIGHTINFER_TOOLS_VENV", ROOT / ".fixture-venv")), help="venv holding GPTQModel + compressed-tensors")
    ap.add_argument("--method", default="rtn", choices=["rtn", "awq"], help="lightinfer quantize's method")
    ap.add_argument("--calib-samples", type=int, default=16, help="GPTQ calibration sequences (of --calib-len)")
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/lightinfer-format-quality"))
    ap.add_argument("--reuse", action="store_true", help="keep checkpoints and references already in --work")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    venv = args.tools_venv if (args.tools_venv / "bin" / "python").is_file() else None
    ids_file = prepare(args.work, args.max_tokens, args.window, args.calib_samples, args.calib_len)
    n_ids = len(json.loads(ids_file.read_text())["ids"])
    res: dict[str, Any] = {
        "model": MODEL, "text": "built-in held-out text (lightinfer.quant.calib, eval half)", "window": args.window,
        "tokens": n_ids, "tolerance": TOLERANCE, "lightinfer_quantize_method": args.method,
        "gptq_calibration": f"{args.calib_samples} x {args.calib_len} tokens of the calibration half",
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "note": "2 shared cores; seconds are noise"},
        "formats": {}}
    for name in args.only or CASES:
        print(f"== {name}", flush=True)
        if not name.startswith("gguf-") and venv is None:
            res["formats"][name] = {"skipped": f"no tools venv at {args.tools_venv} (see format_quality_tools.py)"}
            print(f"  skipped: {res['formats'][name]['skipped']}", flush=True)
            continue
        path, ref = make_case(name, args.work, ids_file, venv, args.method, args.reuse)
        entry: dict[str, Any] = {"checkpoint": str(path), "reference": ref}
        for dtype in ("float32", "auto"):
            r = _ppl(str(path), "auto", args.window, args.max_tokens, dtype=dtype)
            if r["tokens_scored"] != ref["tokens_scored"]:
                raise SystemExit(f"{name}: lightinfer scored {r['tokens_scored']} tokens, the reference "
                                 f"{ref['tokens_scored']}: the tokenizers differ")
            r["rel_diff"] = round(r["ppl"] / ref["ppl"] - 1, 6)
            entry[dtype] = r
        entry["pass"] = abs(entry["float32"]["rel_diff"]) <= TOLERANCE
        res["formats"][name] = entry
        print(f"  {name}: ref {ref['ppl']:.4f}  float32 {entry['float32']['ppl']:.4f} "
              f"({entry['float32']['rel_diff']:+.3%})  auto {entry['auto']['ppl']:.4f} "
              f"({entry['auto']['rel_diff']:+.3%})", flush=True)
        write_results(res, args.out_dir)
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_results(res, args.out_dir)
    return res


if __name__ == "__main__":
    main()
