"""CPU matrix-product candidates at SmolLM2-135M's shapes: µs per call, ratio to fp32 ``F.linear``, error, bytes.

    .venv/bin/python bench/cpu_gemm.py                     # all candidates, writes bench/results/cpu_gemm.{json,md}
    .venv/bin/python bench/cpu_gemm.py --rows 1 16 --no-compile --no-torchao     # a quicker look

Shapes (in -> out): 576->960 (q,k,v fused), 576->576 (o), 576->3072 (gate,up fused), 1536->576
(down), 576->49152 (the tied LM head), each for 1, 4, 16 and 512 rows (``--rows``), on the cores
this process may use (``torch.set_num_threads``; ``--threads``). Each cell is the median of
repeated calls (at least ``--min-reps`` and ``--min-time`` seconds) after warm-up calls, fp32
activations in (casts to bf16/int8 count in the call). Candidates: fp32 ``F.linear``; lightinfer's
oneDNN-prepacked fp32 (``lightinfer.layers.cpu_gemm.PackedWeight``); bf16 ``F.linear``; torch's
int4 CPU kernel ``_weight_int4pack_mm_for_cpu`` at groups 32/64/128; int8 weight-only
``_weight_int8pack_mm``; int8 dynamic quantized linear (``quantized::linear_dynamic`` on fbgemm
and onednn, activations per tensor; and per-row activations with ``torch._int_mm``); a 4-bit
dequantize-in-blocks fallback; ``torch.compile`` of 4-bit dequant + matmul; and torchao's CPU
layouts, run in ``.peers/torchao-venv`` (made on first use: a venv with torch 2.13.0 and torchao;
``--no-torchao`` skips it). Weights are random (std 0.02), 4-bit ones group-quantized from them
(asymmetric, group ``--group-size``, 32 as the embedded Q4_1 GGUF). Error: max |y - y_ref| /
max |y_ref| at 16 rows, against the fp32 product with the weight the candidate stands for (its own
dequantized weight: the kernel's error) and against the fp32 weight (adds the quantization error).
Timings on a shared machine are noise; only ratios within one run carry over. Under heavy load, 2-thread
wall times are dominated by OpenMP waiting for a descheduled thread (a 30 µs product takes 30 ms);
there ``--threads 1 --clock cpu`` (the CPU time of single-threaded calls) still ranks the candidates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_gemm_candidates as C
from peers.install import cpu_name

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv 576->960": (576, 960), "o 576->576": (576, 576), "gate_up 576->3072": (576, 3072),
          "down 1536->576": (1536, 576), "lm_head 576->49152": (576, 49152)}
BASELINE = "fp32 F.linear"
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def builders(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The in-process candidates, in table order: (name, builder)."""
    out = [(BASELINE, C.fp32_linear), ("fp32 prepacked oneDNN (lightinfer today)", C.fp32_prepacked),
           ("bf16 F.linear", C.bf16_linear)]
    out += [(f"int4 _weight_int4pack_mm_for_cpu g{g} (bf16)", C.int4pack_for_cpu(g)) for g in (32, 64, 128)]
    out += [(f"lightinfer W4 g{args.group_size} (cpu_lowbit: C product, int16 act. per 32)", C.lightinfer_w4("c")),
            (f"lightinfer W4 g{args.group_size} (cpu_lowbit: C W4A8, int8 act. per 32)", C.lightinfer_w4("int8")),
            (f"lightinfer W4 g{args.group_size} (cpu_lowbit: int4 GEMM, bf16)", C.lightinfer_w4("torch")),
            ("lightinfer W8 g32 (cpu_lowbit: two int4 halves, bf16)", C.lightinfer_w8)]
    out += [("int8 weight-only _weight_int8pack_mm (fp32)", C.int8_weight_only(torch.float32)),
            ("int8 weight-only _weight_int8pack_mm (bf16)", C.int8_weight_only(torch.bfloat16)),
            ("int8 dynamic linear_dynamic fbgemm (act per tensor)", C.int8_dynamic("fbgemm")),
            ("int8 dynamic linear_dynamic onednn (act per tensor)", C.int8_dynamic("onednn")),
            ("int8 dynamic _int_mm (act per row)", C.int8_dynamic_per_row)]
    g = args.group_size
    out += [(f"4-bit g{g} dequant-blocks fp32 (N blocks)", C.dequant_blocks("N", torch.float32, args.block_bytes)),
            (f"4-bit g{g} dequant-blocks bf16 (N blocks)", C.dequant_blocks("N", torch.bfloat16, args.block_bytes)),
            (f"4-bit g{g} dequant-blocks fp32 (K blocks)", C.dequant_blocks("K", torch.float32, args.block_bytes))]
    if args.compile:
        out += [(f"torch.compile 4-bit g{g} dequant+mm", C.compiled("mm")),
                (f"torch.compile 4-bit g{g} fused GEMV (<=16 rows)", C.compiled("gemv"))]
    if args.only:  # the baseline always stays: every ratio is against it
        out = [(label, b) for label, b in out if label == BASELINE or any(o in label for o in args.only)]
    return out


def time_us(fn: C.Fn, x: torch.Tensor, min_reps: int, min_time: float,
            clock: Callable[[], float] = time.perf_counter) -> tuple[float, float, float]:
    """(median µs per call, fastest call µs, first call µs): two warm-up calls, then calls until ``min_reps``
    and ``min_time`` (wall seconds). The fastest call is kept too: on a shared machine it is the less
    disturbed figure. ``clock`` is wall time, or the process's CPU time (``--clock cpu``)."""
    t0 = clock()
    fn(x)
    first = clock() - t0
    fn(x)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and len(times) < 1000):
        t0 = clock()
        fn(x)
        times.append(clock() - t0)
    return statistics.median(times) * 1e6, min(times) * 1e6, first * 1e6


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def measure(build_list: list[tuple[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per (candidate, shape): µs per row count, first-call µs, errors and weight bytes (or why skipped)."""
    torch.set_grad_enabled(False)  # no autograd records in the timed calls (torchao's weights are nn.Parameters)
    records = []
    for shape_name, (k, n) in SHAPES.items():
        if shape_name not in args.shapes:
            continue
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen) * 0.02
        q4 = C.Quant4.of(w, args.group_size)
        xs = {m: torch.randn(m, k, generator=gen) for m in args.rows}
        x_err = torch.randn(16, k, generator=gen)
        for label, build in build_list:
            rec: dict[str, Any] = {"shape": shape_name, "in": k, "out": n, "candidate": label}
            try:
                cand = build(w, q4)
            except Exception as e:  # noqa: BLE001 - a missing op or a refused shape is a result, not a crash
                records.append({**rec, "skipped": f"{type(e).__name__}: {e}"[:300]})
                print(f"  {shape_name:20s} {label}: skipped ({e})"[:160], flush=True)
                continue
            rec |= {"weight_bytes": cand.weight_bytes, "fp32_bytes": w.numel() * 4, "us": {}, "us_min": {},
                    "first_call_us": {}}
            try:
                y = cand.fn(x_err)
                rec["rel_err_own"] = rel_err(y, x_err @ cand.reference.t())
                rec["rel_err_fp32"] = rel_err(y, x_err @ w.t())
                for m, x in xs.items():
                    if cand.max_rows is not None and m > cand.max_rows:
                        continue
                    rec["us"][str(m)], rec["us_min"][str(m)], rec["first_call_us"][str(m)] = (
                        round(v, 1) for v in time_us(cand.fn, x, args.min_reps, args.min_time, CLOCKS[args.clock]))
            except Exception as e:  # noqa: BLE001 - an op refusing a shape at call time is a result, not a crash
                rec["skipped"] = f"{type(e).__name__}: {e}"[:300]
            records.append(rec)
            print(f"  {shape_name:20s} {label:52s} " + (rec.get("skipped") or " ".join(
                f"{m}:{us:,.0f}" for m, us in rec["us"].items())), flush=True)
    return records


# ---------------------------------------------------------------- torchao, in its own venv
def torchao_python(peers: Path) -> Path:
    return peers / "torchao-venv" / "bin" / "python"


def ensure_torchao_venv(peers: Path) -> Path:
    """``peers/torchao-venv``: a new venv with torch 2.13.0 (the CPU build here) and torchao; returns its python."""
    python = torchao_python(peers)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(python.parents[1])], check=True)
    check = subprocess.run([str(python), "-c", "import torchao"], capture_output=True, check=False)
    if check.returncode != 0:
        subprocess.run(["nice", "-n", "10", str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "torchao",
                        "numpy"], check=True)
    return python


def run_torchao_child(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    """Measure torchao's candidates in the torchao venv (this script with ``--torchao-child``).

    Returns the records and torchao's version (None when it could not run: one "skipped" record says why).
    """
    try:
        python = ensure_torchao_venv(args.peers_dir)
    except (subprocess.CalledProcessError, OSError) as e:
        return [{"candidate": "torchao", "shape": "all", "skipped": f"torchao venv could not be made: {e}"}], None
    out = args.out_dir / f".{args.name}_torchao.json"
    argv = [str(python), str(Path(__file__).resolve()), "--torchao-child", "--json-out", str(out),
            "--threads", str(args.threads), "--group-size", str(args.group_size), "--min-reps", str(args.min_reps),
            "--min-time", str(args.min_time), "--clock", args.clock, "--rows", *map(str, args.rows), "--shapes", *args.shapes]
    print(f"[torchao] {' '.join(argv)}", flush=True)
    rc = subprocess.run(argv, check=False).returncode
    if rc != 0 or not out.is_file():
        return [{"candidate": "torchao", "shape": "all", "skipped": f"the torchao run failed (exit {rc})"}], None
    got = json.loads(out.read_text())
    out.unlink()
    return got["records"], got["torchao"]


# ---------------------------------------------------------------- report
def _ratio(rec: dict[str, Any], base: dict[str, Any] | None, m: str, stat: str = "us") -> float | None:
    if not base or m not in rec.get(stat, {}) or m not in base.get(stat, {}):
        return None
    return round(rec[stat][m] / base[stat][m], 3)


def markdown(result: dict[str, Any]) -> str:
    """One table per shape (µs per call and ratio to fp32 F.linear per row count), then error and memory."""
    meta, records, rows = result["meta"], result["records"], [str(m) for m in result["settings"]["rows"]]
    lines = ["# CPU matrix-product candidates at SmolLM2-135M's shapes", "",
             f"Taken {meta['date']} on {meta['cpu']}, {meta['threads']} threads, {meta.get('clock', 'wall')} clock, "
             f"torch {meta['torch']}"
             + (f", torchao {meta['torchao']}" if meta.get("torchao") else "") + ". " + meta["conditions"], "",
             ("µs per call (median), and in brackets its ratio to fp32 `F.linear` of the same run (below 1 is "
              "faster), then the same ratio of the fastest calls (less disturbed by other load on a shared machine)."),
             "fp32 activations in; casts to bf16 / int8 are part of the call."]
    for shape in dict.fromkeys(r["shape"] for r in records if r["shape"] != "all"):
        base = next((r for r in records if r["shape"] == shape and r["candidate"] == BASELINE), None)
        lines += ["", f"## {shape}", "", "| candidate | " + " | ".join(f"{m} rows" for m in rows) + " |",
                  "|---|" + "---|" * len(rows)]
        for r in (r for r in records if r["shape"] == shape and "skipped" not in r):
            cells = []
            for m in rows:
                if m not in r["us"]:
                    cells.append("–")
                    continue
                ratio, fastest = _ratio(r, base, m), _ratio(r, base, m, "us_min")
                cells.append(f"{r['us'][m]:,.0f}" + (f" ({ratio:.2f}; {fastest:.2f})" if ratio is not None else ""))
            lines.append(f"| {r['candidate']} | " + " | ".join(cells) + " |")
    lines += ["", "## Error and memory", "",
              ("Max relative error at 16 rows against the fp32 product with the candidate's own weight (the kernel's "
               "error) and with the fp32 weight (adds quantization); weight bytes summed over the five shapes "
               "(one layer's linears + the LM head), and against fp32; first call: the slowest first call over "
               "shapes and row counts (a torch.compile candidate compiles there)."), "",
              "| candidate | error, own weight | error, fp32 weight | weight MB | vs fp32 | first call, ms (max) |",
              "|---|---|---|---|---|---|"]
    for cand in dict.fromkeys(r["candidate"] for r in records if "skipped" not in r):
        mine = [r for r in records if r["candidate"] == cand and "skipped" not in r]
        total, fp32 = sum(r["weight_bytes"] for r in mine), sum(r["fp32_bytes"] for r in mine)
        first = max((v for r in mine for v in r["first_call_us"].values()), default=0) / 1000
        note = "" if len(mine) == len(result["settings"]["shapes"]) else f" ({len(mine)} shapes)"
        lines.append(f"| {cand} | {max(r['rel_err_own'] for r in mine):.1e} | {max(r['rel_err_fp32'] for r in mine):.1e} "
                     f"| {total / 1e6:.1f}{note} | {total / fp32:.2f} | {first:,.0f} |")
    skipped = [r for r in records if "skipped" in r]
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {r['candidate']} ({r['shape']}): {r['skipped']}" for r in skipped]
    return "\n".join(lines) + "\n"


def _conditions(threads: int, clock: str) -> str:
    load = os.getloadavg()[0]
    if load <= 0.5 * len(os.sched_getaffinity(0)):
        return f"Load average {load:.1f} at the start: an idle machine."
    if clock == "cpu":
        return (f"Load average {load:.1f} at the start: **a busy machine**; CPU time of single-threaded calls, "
                "which other load disturbs little (but it cannot show contention for memory bandwidth).")
    return (f"Load average {load:.1f} at the start: **a busy machine**: with {threads} threads, wall times and "
            "even their ratios are noise (OpenMP waits for descheduled threads); `--threads 1 --clock cpu` ranks "
            "the candidates on such a machine.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 512], help="row counts M (default 1 4 16 512)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                    help=f"subset of: {', '.join(repr(s) for s in SHAPES)}")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch threads (default: the cores this process may use)")
    ap.add_argument("--group-size", type=int, default=32, help="4-bit group size of the generic candidates")
    ap.add_argument("--block-bytes", type=int, default=512 * 1024, help="dequantized bytes per block (fallback)")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per cell, at least")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall time (default), or this process's CPU time: with --threads 1, a figure that "
                    "other load on a shared machine disturbs much less (it cannot see memory-bandwidth contention)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile candidates")
    ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                    help="measure only the candidates whose name contains one of these (fp32 F.linear always)")
    ap.add_argument("--no-torchao", dest="torchao", action="store_false", help="skip torchao (its own venv)")
    ap.add_argument("--peers-dir", type=Path, default=ROOT / ".peers")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="cpu_gemm")
    ap.add_argument("--torchao-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.threads < 1:
        ap.error("--rows and --threads must be >= 1")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1: with more threads the CPU time counts OpenMP's spin-waits")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.torchao_child:  # inside .peers/torchao-venv
        import cpu_gemm_torchao
        import torchao

        records = measure(cpu_gemm_torchao.builders(args.group_size), args)
        args.json_out.write_text(json.dumps({"torchao": torchao.__version__, "records": records}))
        return {}
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_name(),
            "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
            "conditions": _conditions(args.threads, args.clock)}
    print(f"[cpu_gemm] {meta['conditions']}", flush=True)
    records = measure(builders(args), args)
    if args.torchao:
        torchao_records, meta["torchao"] = run_torchao_child(args)
        records += torchao_records
    result = {"meta": meta, "settings": {k: v for k, v in vars(args).items() if k in (
        "rows", "shapes", "threads", "clock", "group_size", "block_bytes", "min_reps", "min_time")}, "records": records}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
