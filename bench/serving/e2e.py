"""End-to-end benchmark: lightinfer against transformers ``generate`` on the same workload, one run.

Offline throughput in the manner of vLLM's ``benchmark_throughput`` (random dataset): N requests,
prompt and output lengths drawn uniformly from ranges with a fixed seed, random token ids,
``ignore_eos``, temperature 1, all submitted at once. Then batch-1 decode (a 128-token prompt,
256 new tokens, greedy): decode tokens/s, time to first token. Peak memory. The same
throughput workload (or its first ``--hf-num-prompts`` requests: a rate does not depend on the
count) runs through transformers fp16 ``generate`` in static batches of ``--hf-batch-size``,
and batch-1 through ``generate`` too, all in the same process.

A model is a Hugging Face folder or a config folder from ``bench/configs/`` with
``--dummy-weights`` (random weights built on the GPU; transformers gets random weights of the
same config, so both run the same shapes). Writes ``bench/results/e2e_<name>.json`` and a PNG.

    python -m bench.serving.e2e bench/configs/llama-2-7b --dummy-weights --quantization awq \\
        --kv-cache-dtype int8 [--max-vram 12GiB] [--hf-num-prompts 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common.results import RESULTS, write_json


@dataclass(frozen=True)
class Request:
    """One benchmark request: random prompt ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def make_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> list[Request]:
    """``num`` requests, lengths uniform in the inclusive ranges, ids uniform in ``[0, vocab_size)``."""
    rng = random.Random(seed)
    return [Request([rng.randrange(vocab_size) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(num)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory(device: torch.device) -> dict[str, int]:
    """On CUDA the allocator's reserved peak since the last reset (this run alone); on a CPU only the
    process's peak RSS exists, which includes every run before it in this process."""
    if device.type == "cuda":  # reserved: what the process held (lightinfer's includes its whole KV pool)
        return {"peak_memory_bytes": int(torch.cuda.max_memory_reserved(device))}
    return {"process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_lightinfer(args: argparse.Namespace, requests: list[Request], b1_prompt: list[int]) -> dict:
    """Throughput over ``requests`` and batch-1 decode through ``LLM.generate``."""
    from lightinfer import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
              load_format="dummy" if args.dummy_weights else "auto", quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_vram=args.max_vram, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory)
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    info = engine.model_info()
    device = torch.device(info["device"])
    # Warm-up: Triton compiles each kernel variant at first use (prefill of every GEMM path, decodes).
    warm = [Request(r.prompt_token_ids, 4) for r in requests[:4]] + [Request(b1_prompt, 8)]
    llm.generate([r.prompt_token_ids for r in warm], [SamplingParams(max_tokens=r.output_len, ignore_eos=True)
                                                      for r in warm], use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # As vLLM's benchmark_throughput: no per-request seed (the engine's generator is seeded; a seed per
    # request would cost one noise kernel per row and step).
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    preempt0 = engine.get_stats().num_preemptions
    _sync()
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(r.output_len for r in requests), "ignore_eos requests must deliver every token"
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)

    one = llm.generate([b1_prompt], SamplingParams(temperature=0, max_tokens=args.batch1_output_len,
                                                    ignore_eos=True), use_tqdm=False)[0]
    m = one.metrics
    n = len(one.outputs[0].token_ids)
    result = {
        "startup_s": startup_s,
        "weight_bytes": info["weight_bytes"],
        "kv_cache_tokens": info["kv_pool_tokens"],
        # the pool's bytes: the one figure model_info() does not give (the model runner's KV spec)
        "kv_cache_bytes": info["num_kv_blocks"] * engine.model_runner.kv_spec.bytes_per_block,
        "throughput": {"elapsed_s": elapsed, "requests_per_s": len(requests) / elapsed,
                       "output_tokens_per_s": out_tokens / elapsed,
                       "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed,
                       "preemptions": engine.get_stats().num_preemptions - preempt0},
        "batch1": {"prompt_tokens": len(b1_prompt), "output_tokens": n,
                   "decode_tokens_per_s": (n - 1) / (m.finished_time - m.first_token_time),
                   "end_to_end_tokens_per_s": n / (m.finished_time - m.arrival_time),
                   "time_to_first_token_s": m.time_to_first_token},
        "dtype": info["dtype"],
        **_peak_memory(device),
    }
    if args.profile_steps:
        prof = result["batch1"]["profile"] = profile_decode(engine, b1_prompt, args.profile_steps)
        busy = f", device busy {prof['device_busy_ms']:.3f} ms, {prof['kernels_per_step']:.0f} kernels" \
            if prof["device_busy_ms"] is not None else ""
        print(f"batch-1 decode step {prof['step_ms']:.3f} ms{busy}; by time per step:", flush=True)
        for r in prof["top"][:10]:
            print(f"  {r['us_per_step']:9.1f} us {r['share']:6.1%} {r['calls_per_step']:6.1f}x  {r['name'][:90]}")
    del llm, engine, outs
    _free_memory()
    return result


def profile_decode(engine: object, prompt_ids: list[int], steps: int, top: int = 15) -> dict:
    """``steps`` batch-1 decode steps of ``engine`` (an ``LLMEngine``) under ``torch.profiler``: where a step's
    time goes. Prefill runs before the profile starts.

    Returns:
        ``step_ms`` (wall time per step, synchronised), ``device_busy_ms`` (kernel time per step; CUDA only),
        ``kernels_per_step``, and the ``top`` kernels (or CPU ops without CUDA) by time per step:
        ``name``, ``calls_per_step``, ``us_per_step``, ``share`` of the device time. A step much longer than
        its kernels is launch- or host-bound; a kernel far below the bandwidth shows in its line.
    """
    from torch.profiler import ProfilerActivity, profile

    from lightinfer import SamplingParams

    cuda = torch.device(engine.model_info()["device"]).type == "cuda"
    engine.add_request("profile-decode", list(prompt_ids),
                       SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # prefill (and the first token) outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        on_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device == cuda and (cuda or e.cpu_parent is None):  # CPU: top-level ops only, no double count
            entry = rows.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total if cuda else e.cpu_time_total
    busy = sum(us for _, us in rows.values())
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]
    result = {
        "steps": steps, "step_ms": wall / steps * 1e3,
        "kernels_per_step": sum(n for n, _ in rows.values()) / steps if cuda else None,
        "device_busy_ms": busy / steps / 1e3 if cuda else None,
        "top": [{"name": name[:120], "calls_per_step": n / steps, "us_per_step": us / steps,
                 "share": us / busy if busy else 0.0} for name, (n, us) in ranked],
    }
    return result


def hf_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of the same config: the checkpoint's weights, or random ones (dummy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not args.dummy_weights:  # an AWQ folder needs its fp16 source here: --hf-model
        return AutoModelForCausalLM.from_pretrained(args.hf_model or args.model, dtype=dtype,
                                                    trust_remote_code=False).to(device).eval()
    config = AutoConfig.from_pretrained(args.hf_model or args.model, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the baseline is the fp16 model
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    return model.eval()


@torch.no_grad()
def run_hf(args: argparse.Namespace, requests: list[Request], b1_prompt: list[int], device: torch.device) -> dict:
    """The same workload through ``generate``: left-padded static batches, every request's batch
    generating its longest output (``min_new_tokens`` = ``max_new_tokens``, as ``ignore_eos``)."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = hf_model(args, device, dtype)
    reqs = requests[: args.hf_num_prompts or len(requests)]
    common = {"pad_token_id": 0, "eos_token_id": None}
    model.generate(torch.tensor([b1_prompt[:16]], device=device), max_new_tokens=2, **common)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync()
    t = time.perf_counter()
    for i in range(0, len(reqs), args.hf_batch_size):
        batch = reqs[i: i + args.hf_batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0, top_p=1.0,
                       top_k=0, max_new_tokens=new, min_new_tokens=new, **common)
    _sync()
    elapsed = time.perf_counter() - t
    # Delivered tokens: what each request asked for (a static batch computes more and throws it away).
    out_tokens = sum(r.output_len for r in reqs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    t = time.perf_counter()
    model.generate(torch.tensor([b1_prompt], device=device), do_sample=False, max_new_tokens=args.batch1_output_len,
                   min_new_tokens=args.batch1_output_len, **common)
    _sync()
    b1_s = time.perf_counter() - t
    result = {
        "dtype": str(dtype).replace("torch.", ""), "num_prompts": len(reqs), "batch_size": args.hf_batch_size,
        "throughput": {"elapsed_s": elapsed, "requests_per_s": len(reqs) / elapsed,
                       "output_tokens_per_s": out_tokens / elapsed,
                       "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed},
        "batch1": {"end_to_end_tokens_per_s": args.batch1_output_len / b1_s},
        **_peak_memory(device),
    }
    del model
    _free_memory()
    return result


def plot(result: dict, path: Path) -> None:
    """Bars: output tokens/s (throughput) and batch-1 tokens/s, lightinfer against transformers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, hf = result["lightinfer"], result.get("transformers")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    panels = [("throughput, output tok/s", ours["throughput"]["output_tokens_per_s"],
               hf and hf["throughput"]["output_tokens_per_s"]),
              ("batch 1, tok/s (end to end)", ours["batch1"]["end_to_end_tokens_per_s"],
               hf and hf["batch1"]["end_to_end_tokens_per_s"])]
    for ax, (title, a, b) in zip(axes, panels):
        names, values = ["lightinfer"], [a]
        if b:
            names.append(f"transformers {hf['dtype']}")
            values.append(b)
        bars = ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(values)])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(title)
    kv = "INT8" if result["kv_cache_dtype"] == "int8" else ours["dtype"]
    fig.suptitle(f"{result['model']} ({result['weights_format']}, {kv} KV cache) on {result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face folder, or a bench/configs/ folder with --dummy-weights")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--quantization", default=None, choices=["awq"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-vram", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-memory", default=None, help="KV pool size (CPU runs)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--batch1-prompt-len", type=int, default=128)
    ap.add_argument("--batch1-output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-steps", type=int, default=32,
                    help="batch-1 decode steps to profile (where a step's time goes); 0: none")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-num-prompts", type=int, default=None, help="time HF on the first N requests only")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--hf-model", default=None, help="the baseline's fp16 model folder (default: MODEL)")
    ap.add_argument("--name", default=None, help="result name (default: the model folder's name)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    for flag, (lo, hi) in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if not 1 <= lo <= hi:
            ap.error(f"{flag} MIN MAX needs 1 <= MIN <= MAX, got {lo} {hi}")
    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--hf-batch-size", args.hf_batch_size, 1),
                               ("--batch1-prompt-len", args.batch1_prompt_len, 1),
                               ("--batch1-output-len", args.batch1_output_len, 2),
                               ("--hf-num-prompts", args.hf_num_prompts or 1, 1),
                               ("--profile-steps", args.profile_steps + 1, 1)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    return args


def preflight(args: argparse.Namespace) -> tuple[int, int, bool]:
    """Check what would fail late (after minutes of baseline) before anything runs.

    Returns:
        ``(vocab_size, max_model_len, quantized)`` of the model as lightinfer will run it.
    Raises:
        ValueError: requests longer than the model's context, ``--quantization awq`` on a
            checkpoint that is not AWQ, or an AWQ checkpoint as the transformers baseline.
    """
    from lightinfer.loader import Checkpoint

    ckpt = Checkpoint(args.model, read_weights=False)
    hf = ckpt.hf_config
    max_len = args.max_model_len or min(int(getattr(hf, "max_position_embeddings", 8192)), 8192)
    longest = max(args.input_len[1] + args.output_len[1], args.batch1_prompt_len + args.batch1_output_len,
                  args.batch1_prompt_len + args.profile_steps + 2)
    if longest > max_len:
        raise ValueError(f"a request can reach {longest} tokens (prompt + output) but the model runs with "
                         f"max_model_len={max_len}: shorten --input-len/--output-len or raise --max-model-len")
    quantized = ckpt.quant_config is not None or (args.dummy_weights and args.quantization == "awq")
    if args.quantization == "awq" and ckpt.quant_config is None and not args.dummy_weights:
        raise ValueError(f"--quantization awq, but {args.model} is not an AWQ checkpoint (or add --dummy-weights)")
    if ckpt.quant_config is not None and not (args.dummy_weights or args.no_hf or args.hf_model):
        raise ValueError(f"{args.model} is an AWQ checkpoint: give its fp16 source as the baseline with "
                         f"--hf-model DIR, or skip the baseline with --no-hf")
    if not torch.cuda.is_available() and not args.no_hf:  # transformers would be OOM-killed, not refuse
        from lightinfer.engine.memory import available_host_bytes, check_host_memory
        from lightinfer.models.registry import get_model_class

        with torch.device("meta"):
            skeleton = get_model_class(hf)(hf, None, torch.float32)
        check_host_memory({"transformers fp32 baseline": sum(p.numel() * 4 for p in skeleton.parameters())},
                          available_host_bytes())
    return int(hf.vocab_size), max_len, quantized


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    vocab, max_len, quantized = preflight(args)
    requests = make_requests(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    b1_prompt = make_requests(1, (args.batch1_prompt_len,) * 2, (1, 1), vocab, args.seed + 1)[0].prompt_token_ids
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = args.name or Path(args.model).name
    result: dict = {
        "model": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else
        f"{platform.machine()} CPU ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "weights": "dummy (random)" if args.dummy_weights else "checkpoint",
        "weights_format": "AWQ W4A16" if quantized else "dense", "kv_cache_dtype": args.kv_cache_dtype,
        "max_model_len": max_len, "max_vram": args.max_vram,
        "workload": {"num_prompts": args.num_prompts, "input_len": list(args.input_len),
                     "output_len": list(args.output_len), "seed": args.seed, "temperature": 1.0, "ignore_eos": True,
                     "batch1_prompt_len": args.batch1_prompt_len, "batch1_output_len": args.batch1_output_len},
    }
    # transformers first: it frees cleanly, and our engine sizes its KV pool from the memory left.
    if not args.no_hf:
        result["transformers"] = run_hf(args, requests, b1_prompt, device)
        print("transformers:", json.dumps(result["transformers"]), flush=True)
    result["lightinfer"] = run_lightinfer(args, requests, b1_prompt)
    print("lightinfer:", json.dumps(result["lightinfer"]), flush=True)
    if not args.no_hf:
        ours, hf = result["lightinfer"], result["transformers"]
        result["ratios"] = {
            "throughput_output_tokens": ours["throughput"]["output_tokens_per_s"] / hf["throughput"]["output_tokens_per_s"],
            "batch1_end_to_end": ours["batch1"]["end_to_end_tokens_per_s"] / hf["batch1"]["end_to_end_tokens_per_s"],
        }
        print("ratios:", json.dumps(result["ratios"]), flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / f"e2e_{name}.json", result)
    try:
        plot(result, out_dir / f"e2e_{name}.png")
    except ImportError:  # the GPU image may lack matplotlib: plot later from the JSON
        print("matplotlib missing: no PNG written")
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
