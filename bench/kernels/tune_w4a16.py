"""Tune the W4A16 GEMM on this GPU: the fastest path, tile, pipeline depth and split-K per weight shape and M.

For each linear layer shape of the given models (``bench/configs/<model>``: the fused qkv, o, fused
gate/up and down projections) and each M, it times the launcher's built-in choice and a staged search
over the other launches (:func:`candidates`: first the tile at the default pipeline depth, then the
depth and warps of the best tile, then its split-K), re-times the best three and the built-in choice
in a longer final round; a candidate whose output is off the fp32 reference is never timed. The
winners go to ``kernels/configs/w4a16_<device>.json`` (merged into what the file already holds), which
``lightinfer.kernels.w4a16_tuning`` reads at run time on that GPU model.

Work goes M by M (decode sizes first) across all shapes, and stops starting new ones past ``--budget-s``:
a cut-short run still writes a valid file (written atomically after every pair; M values above the largest
tuned one keep the built-in launch), and a second run fills in the rest (``--skip-done``). A full run of
the two default models is ~440 kernel compiles (~1 s each) and ~4,300 short timings, about 11 minutes:
on a device with 10-minute calls, copy the file a call returned into ``kernels/configs/`` and call again
with ``--skip-done``.
Timing replays CUDA graphs over weight copies that rotate past the L2: a short :func:`graph_us` in the
search rounds, ``bench.common.gpu_timing.bench_us`` for the finalists.

    python -m bench.kernels.tune_w4a16 [--models llama-2-7b llama-3-8b] [--m 1 2 4 ...] [--budget-s 420] [--out F]

Needs a CUDA GPU (exits with status 2 without one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.common.results import CONFIGS

M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
FINALISTS = 3
SPLIT_MAX_M = 64  # the split-K round runs up to this M
# A candidate's output against the fp32 reference: the same bound tests/gpu/test_kernels_gpu.py holds every
# launch to (the built-in ones reach ~3e-4 on these weights).
MAX_REL_ERR = 3e-3

TimeFn = Callable[[Any], float]  # W4Launch -> µs


def model_shapes(model: str, configs_dir: Path = CONFIGS) -> dict[str, tuple[int, int]]:
    """``{"<model>/qkv": (K, N), ...}`` for the four W4 linear layers of ``configs_dir/model/config.json``
    (q/k/v and gate/up fused, as the engine loads them).

    Raises:
        FileNotFoundError: no such config folder (naming the ones there are).
    """
    path = configs_dir / model / "config.json"
    if not path.exists():
        have = sorted(p.name for p in configs_dir.iterdir() if (p / "config.json").exists())
        raise FileNotFoundError(f"no {path}; models with configs: {', '.join(have)}")
    c = json.loads(path.read_text())
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    return {f"{model}/qkv": (hidden, (heads + 2 * kv_heads) * head_dim), f"{model}/o": (heads * head_dim, hidden),
            f"{model}/gate_up": (hidden, 2 * inter), f"{model}/down": (inter, hidden)}


def candidates(path: str, m: int, group_size: int) -> list[Any]:
    """First-round launches of ``path`` for ``m`` rows (pipeline depth 3 or the gemv's, split-K by the
    heuristic): the tile shapes worth timing. The later rounds vary depth, warps and split of the best."""
    from lightinfer.kernels.w4a16_gemm import next_pow2
    from lightinfer.kernels.w4a16_tuning import W4Launch

    g = group_size
    if path == "dequant":
        return [W4Launch("dequant")]
    if path == "gemv":
        bm = next_pow2(m)
        # 4K..32K weights per program and step at M=1, fewer as M grows (the FFMAs' registers grow with M)
        rows = [b for b in (32, 64, 128, 256, 512) if 4096 <= b * g <= 32768 // bm]
        return [W4Launch("gemv", bm, b, g, 4, s) for b in rows for s in (1, 2, 3, 4)]
    if path == "swap_ab":  # weight rows are the MMA's M (>= 64 per warp group), tokens its N (16..256)
        out = []
        tokens = [max(16, next_pow2(m))] if m <= 128 else [128, 256]  # a 256-token tile dequantizes W once per 256
        for bm, bn, bk, w in itertools.product(tokens, (64, 128, 256), (32, 64, 128), (4, 8)):
            if g % bk == 0 and bn >= 16 * w and bm * bn <= 128 * 32 * w and bm * bk + bn * bk <= 128 * 128 * 2:
                out.append(W4Launch("swap_ab", bm, bn, bk, w, 3))
        return out
    if m <= 128:
        space = itertools.product([max(16, next_pow2(m))], (32, 64, 128, 256), (32, 64, 128), (4, 8))
    else:  # compute-bound sizes: only the large tiles (the dequant path usually wins there anyway)
        space = itertools.product((64, 128), (128, 256), (32, 64), (4, 8))
    out = []
    for bm, bn, bk, w in space:
        if g % bk:
            continue
        # Skip what cannot pay: tiles whose x + weight slices outgrow shared memory, 8 warps on small tiles,
        # and over 128 fp32 accumulators per thread (sm_90 with Triton 3.6: 128x256 at 4 warps spills ~450 stores).
        if bm * bk + bn * bk <= 128 * 128 * 2 and not (w == 8 and bm * bn < 64 * 64) and bm * bn <= 128 * 32 * w:
            out.append(W4Launch("tiled", bm, bn, bk, w, 3))
    return out


def paths_for(m: int) -> list[str]:
    """The paths worth timing at ``m`` rows (the GEMV's FFMA work grows with M; dequant only pays at large M). The
    tensor-core paths run at M=1 too: a 16-token tile wastes tensor-core work, not memory traffic, and with the fp16
    pair decode it issues fewer instructions per weight than the GEMV (``kernels/audit/sass_stats.py``)."""
    return [p for p, ok in (("gemv", m <= 8), ("tiled", True), ("swap_ab", m <= 1024), ("dequant", m >= 32)) if ok]


def _variants(best: Any) -> list[Any]:
    """Second-round variants of ``best``: other pipeline depths and the other warp count (4 / 8; 2 warps
    spill on the large tiles and cannot win). Every variant is a new compile (~1 s)."""
    depths = (1, 2, 3, 4) if best.path == "gemv" else (2, 3, 4)
    depth = [replace(best, num_stages=s) for s in depths if s != best.num_stages]
    return depth + [replace(best, num_warps=12 - best.num_warps)] if best.num_warps in (4, 8) else depth


def _rank(timed: dict[Any, float], n: int) -> list[Any]:
    return sorted(timed, key=timed.__getitem__)[:n]


def _best_of(timed: dict[Any, float], path: str) -> Any:
    return _rank({la: us for la, us in timed.items() if la.path == path}, 1)[0]


def tune_one(
    m: int, k: int, group_size: int, default: Any, time_fn: TimeFn, check_fn: Callable[[Any], str | None],
    final_time_fn: TimeFn | None = None, log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The staged search for one (shape, M).

    Args:
        m, k, group_size: the problem (N is in the callbacks).
        default: the built-in launch (always a candidate, and the baseline).
        time_fn: µs of one launch; ``final_time_fn`` (default ``time_fn``) re-times the finalists.
        check_fn: None if a launch's output matches the reference, else why not (the built-in launch is
            not checked: tests hold it to the same bound).
    Returns:
        ``{"best": W4Launch, "us": float, "default_us": float, "timed": int, "rejected": {launch: why}}``.
    """
    timed: dict[Any, float] = {}
    rejected: dict[str, str] = {}

    def try_all(launches: Iterable[Any]) -> None:
        for launch in launches:
            if launch in timed or str(launch) in rejected:
                continue
            why = None if launch == default else check_fn(launch)
            if why is not None:
                rejected[str(launch)] = why
                log(f"  rejected {launch}: {why}")
                continue
            try:
                timed[launch] = time_fn(launch)
            except Exception as e:  # noqa: BLE001 - out of shared memory/registers etc.: not a candidate
                rejected[str(launch)] = repr(e)[:200]

    try_all([default])
    for path in paths_for(m):
        try_all(candidates(path, m, group_size))
        if path == "dequant" or not any(la.path == path for la in timed):
            continue
        try_all(_variants(_best_of(timed, path)))
        best = _best_of(timed, path)
        if m <= SPLIT_MAX_M:  # above, the M x N tiles alone fill the GPU: the heuristic's split stands
            try_all(replace(best, split_k=s) for s in SPLITS if s <= k // best.block_k)
    final = final_time_fn or time_fn
    finalists = list(dict.fromkeys(_rank(timed, FINALISTS) + [default]))
    final_us = {launch: final(launch) for launch in finalists}
    best = _rank(final_us, 1)[0]
    return {"best": best, "us": final_us[best], "default_us": final_us[default], "timed": len(timed),
            "rejected": rejected}


def graph_us(fn: Callable[[], Any], calls: int, target_ms: float = 2.0, rounds: int = 5) -> float:
    """µs per launch of ``fn`` (which makes ``calls`` launches), median of ``rounds``: ``fn`` captured once in
    a CUDA graph, replayed back to back for about ``target_ms`` per round. About 15 ms per timing where
    ``do_bench_cudagraph`` takes 10 x its ``rep`` (the search times thousands of launches)."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(1, int(target_ms / max(start.elapsed_time(end), 1e-3)))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * calls))
    return sorted(times)[len(times) // 2]


def tune_shape_m(
    k: int, n: int, m: int, group_size: int, quick: bool, log: Callable[[str], None],
    device: str = "cuda", timer: Callable[[Callable[[], Any], bool], float] | None = None,
) -> dict[str, Any]:
    """Tune one (shape, M) with real kernels; returns :func:`tune_one`'s dict.

    ``timer(fn, final)`` gives µs of one call of ``fn``; by default bench/common/gpu_timing.py's CUDA-graph timing
    over weight copies that rotate past the L2 (the CPU test passes its own and runs the interpreter).
    """
    from lightinfer.kernels import reference as ref
    from lightinfer.kernels import w4a16_gemm as wg

    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(k * n)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.int32)
    qweight = ref.pack_int4_rows(codes)
    del codes
    scales = (torch.rand(k // group_size, n, generator=gen, device=device) * 0.01 + 1e-3).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen, device=device).to(dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    sets = [(qweight, scales, zeros)]
    if timer is None:
        from bench.common import gpu_timing as kb

        nw = kb.copies_for(n * k // 2 + 4 * (k // group_size) * n)
        sets += [(qweight.clone(), scales.clone(), zeros.clone()) for _ in range(nw - 1)]

        def timer(fn: Callable[[], Any], final: bool) -> float:
            # search rounds: a short graph timing; finalists: bench/common/gpu_timing.py's (10 x 20-100 ms replays)
            return kb.bench_us(fn, quick, nw) if final else graph_us(fn, nw)

    default = wg.default_launch(m, n, k, group_size, x.device)
    want = ref.w4a16_gemm(x.float(), qweight, scales.float(), zeros.float())

    def check(launch: Any) -> str | None:
        try:
            got = wg.w4a16_gemm_path(x, qweight, scales, zeros, launch=launch, integer_zeros=True).float()
            if x.is_cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - does not compile or launch: reported as the reason
            return repr(e)[:200]
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        return None if err <= MAX_REL_ERR else f"relative error {err:.2e} against the reference"

    def timed(final: bool) -> TimeFn:
        # Integer zeros (AWQ, GPTQ, ...): the decode the launches were built around. A launch serves fractional
        # zeros too (the flag changes the decode, not the launch), untimed here.
        return lambda launch: timer(lambda: [wg.w4a16_gemm_path(x, *w, launch=launch, integer_zeros=True)
                                             for w in sets], final)

    return tune_one(m, k, group_size, default, timed(False), check, timed(True), log)


def read_entries_file(path: Path) -> dict[str, Any]:
    """A tuned file's JSON, or ``{}`` when there is none or it cannot be read (a run killed mid-write before
    writes were atomic, a hand edit): tuning then starts afresh, with a warning, instead of dying after a pair."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("entries", {}), dict):
            return data
    except ValueError:
        pass
    print(f"warning: {path} is not a readable tuned file; starting afresh (it will be overwritten)", file=sys.stderr)
    return {}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a kill leaves the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def merge_entries(path: Path, header: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``path``'s tuned file (if any) with ``results`` (``{shape_key: {M: record}}``) written over it."""
    data = read_entries_file(path)
    entries = data.get("entries", {})
    for key, by_m in results.items():
        entries.setdefault(key, {}).update({str(m): rec for m, rec in by_m.items()})
    for key in entries:  # M keys in numeric order, for people reading the file
        entries[key] = dict(sorted(entries[key].items(), key=lambda kv: int(kv[0])))
    return {**data, **header, "entries": dict(sorted(entries.items()))}


def main(argv: list[str] | None = None) -> int:
    """CLI; returns the exit status (2 without CUDA)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-3-8b"], help="folders under bench/configs")
    p.add_argument("--m", type=int, nargs="+", default=M_VALUES, help="M values (rows of x) to tune, in order")
    p.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128))
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new (shape, M) after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="default: kernels/configs/w4a16_<device>.json")
    p.add_argument("--skip-done", action="store_true", help="skip (shape, M) pairs the output file already has")
    p.add_argument("--quick", action="store_true", help="short final timing too")
    p.add_argument("--copy-to", type=Path, default=None,
                   help="also write the file into this folder after every pair (the device's $OUT)")
    args = p.parse_args(argv)
    shapes: dict[str, tuple[int, int]] = {}
    for model in args.models:
        try:
            shapes.update(model_shapes(model))
        except FileNotFoundError as e:
            p.error(str(e))
    if any(v <= 0 for v in args.m):
        p.error("--m values must be positive")
    if not torch.cuda.is_available():
        print("bench/kernels/tune_w4a16.py needs a CUDA GPU: torch.cuda.is_available() is False. Nothing tuned.", file=sys.stderr)
        return 2
    import triton

    from lightinfer.kernels import w4a16_tuning as wt

    device = torch.cuda.get_device_name()
    out = args.out or wt.device_file(device)
    done = read_entries_file(out).get("entries", {}) if args.skip_done else {}
    from lightinfer.kernels import pdl

    header = {"device": device, "triton": triton.__version__, "torch": torch.__version__,
              "pdl": pdl.pdl_enabled(torch.device("cuda")), "pdl_prefetch": pdl.prefetch_enabled(torch.device("cuda")),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "group_size_tuned": args.group_size,
              "timing": "CUDA-graph replay (bench/common/gpu_timing.py bench_us), median, weights rotated past the L2"}
    t0 = time.monotonic()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for m, (name, (k, n)) in itertools.product(args.m, shapes.items()):
        key = wt.shape_key(n, k, args.group_size)
        if str(m) in done.get(key, {}) or m in results.get(key, {}):
            continue
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: stopping before {name} M={m}", flush=True)
            break
        r = tune_shape_m(k, n, m, args.group_size, args.quick, lambda s: print(s, flush=True))
        torch.cuda.empty_cache()  # this pair's weight copies
        results.setdefault(key, {})[m] = wt.launch_record(r["best"], us=round(r["us"], 3),
                                                          default_us=round(r["default_us"], 3), shape=name)
        print(f"{name:<22} M={m:<5} best {r['us']:8.2f} us  built-in {r['default_us']:8.2f} us  "
              f"x{r['default_us'] / r['us']:.2f}  {r['best']}  ({r['timed']} timed, {len(r['rejected'])} rejected)",
              flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(merge_entries(out, header, {key: results[key]}), indent=1) + "\n"
        write_atomic(out, text)
        if args.copy_to is not None:
            write_atomic(args.copy_to / out.name, text)
    if not out.exists():
        print("nothing tuned (every pair was done already, or the budget was 0)")
        return 0
    wt.parse_file(out)  # what the engine will read must parse
    print(f"wrote {out} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
