"""Mixture-of-experts on the CPU: decode speed against transformers, and the CPU half of ``--cpu-experts``.

**Decode vs transformers** (default): a small random Qwen3-MoE (``SMALL``: 4 layers, 16 experts, top-4, fp32)
saved once with transformers, run by both in the same process: greedy decode at batch 1 and 16 (prompts of
32 tokens, ``--decode-tokens`` new ones). Decode tokens/s = new tokens / (time of prompt + N tokens - time of
prompt + 1 token), for lightinfer (``LLM.generate``: each expert on its routed tokens) and transformers
(``generate``; its experts loop is the same idea, in eager PyTorch); and, without a transformers twin, lightinfer
on the same weights quantized to 4 bits (RTN) in bf16, its experts in torch's int4 GEMM.

**CPU half** (``--cpu-half``): Qwen3-30B-A3B-shaped MoE layers (128 experts, top-8, H 2048, width 768) with
random W4 g128 experts, prepared as the host-resident experts of a GPU engine are (bf16 activations, torch's
int4 GEMM, ``kernels/moe_cpu.py``), timed alone at batch 1 and 16: ms per layer, tokens/s for N host layers,
and the weight bandwidth that implies. The GPU half is then *estimated*, not measured: the other layers'
active weights at ``--gpu-gbps`` (default 216 GB/s: 60% of an RTX 3060 12 GB's 360 GB/s) plus two PCIe hops
per host layer (``--pcie-us``, default 15 µs each).

Writes ``bench/results/moe_cpu.json`` (``moe_cpu_half.json`` with ``--cpu-half``; ``--out``). The machine is shared: timings are medians of repeats and
noisy; read ratios from one run.

    python -m bench.kernels.moe_cpu [--decode-tokens 32] [--repeats 3]
    python -m bench.kernels.moe_cpu --cpu-half [--layers 4] [--host-layers 24]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common.results import RESULTS

SMALL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 1024}
QWEN3_30B_A3B = {"experts": 128, "top_k": 8, "hidden": 2048, "width": 768, "layers": 48, "attention_bytes": 9_830_400}
PROMPT_LEN = 32


def small_checkpoint(folder: Path) -> Path:
    import transformers

    cfg = transformers.Qwen3MoeConfig(**SMALL, architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # routers spread tokens over experts
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _write_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer beside the checkpoint (``quantize`` copies one; its text never matters here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_vs_transformers(batch_sizes: list[int], new_tokens: int, repeats: int) -> list[dict[str, Any]]:
    import transformers

    from lightinfer import LLM, SamplingParams

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = small_checkpoint(Path(tmp) / "qwen3-moe-small")
        hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=16)
        # the same weights 4-bit (RTN), experts in torch's int4 GEMM with bf16 activations (kernels/moe_cpu.py)
        from lightinfer.quant.api import quantize
        from lightinfer.quant.config import QuantConfig

        _write_tokenizer(path)
        quantize(str(path), Path(tmp) / "w4", QuantConfig(method="rtn", format="awq"), progress=False)
        llm_w4 = LLM(str(Path(tmp) / "w4"), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
                     max_num_seqs=16)
        gen = torch.Generator().manual_seed(1)
        for b in batch_sizes:
            ids = torch.randint(0, SMALL["vocab_size"], (b, PROMPT_LEN), generator=gen)
            prompts = ids.tolist()

            def ours(n: int, prompts: list[list[int]] = prompts) -> None:
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

            def theirs(n: int, ids: torch.Tensor = ids) -> None:
                with torch.no_grad():
                    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)

            def ours_w4(n: int, prompts: list[list[int]] = prompts) -> None:
                llm_w4.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

            row: dict[str, Any] = {"batch": b, "prompt_len": PROMPT_LEN, "new_tokens": new_tokens}
            for name, fn in (("lightinfer", ours), ("transformers", theirs), ("lightinfer_w4_bf16", ours_w4)):
                fn(2)  # warm-up
                t_one, t_all = _median_s(lambda f=fn: f(1), repeats), _median_s(lambda f=fn: f(1 + new_tokens), repeats)
                row[f"{name}_decode_tok_per_s"] = b * new_tokens / max(t_all - t_one, 1e-9)
            row["ratio"] = row["lightinfer_decode_tok_per_s"] / row["transformers_decode_tok_per_s"]
            print(f"batch {b:2d}: lightinfer {row['lightinfer_decode_tok_per_s']:8.1f} tok/s, transformers "
                  f"{row['transformers_decode_tok_per_s']:8.1f} tok/s ({row['ratio']:.2f}x); lightinfer W4 bf16 "
                  f"{row['lightinfer_w4_bf16_decode_tok_per_s']:8.1f} tok/s", flush=True)
            rows.append(row)
    return rows


def cpu_half(num_layers: int, host_layers: int, batch_sizes: list[int], repeats: int, gpu_gbps: float,
             pcie_us: float) -> dict[str, Any]:
    from lightinfer.kernels import ExpertWeights, get_backend
    from lightinfer.kernels.moe_cpu import prepare_experts

    s = QWEN3_30B_A3B
    e, k, h, i, g = s["experts"], s["top_k"], s["hidden"], s["width"], 128
    layers = []
    for _ in range(num_layers):
        ws = []
        for n, kk in ((2 * i, h), (h, i)):
            sc = (torch.rand(e, kk // g, n) * 0.004 + 0.002).to(torch.bfloat16)
            w = ExpertWeights(qweight=torch.randint(-2**31, 2**31 - 1, (e, n, kk // 8), dtype=torch.int32), scales=sc,
                              zeros=torch.full_like(sc, 8.0))
            w.prepared = prepare_experts(w, torch.bfloat16)
            ws.append(w)
        layers.append(ws)
    ops = get_backend("torch_cpu")
    kind = layers[0][0].prepared.kind
    out: dict[str, Any] = {"shape": s, "layers_timed": num_layers, "prepared_kind": kind,
                           "threads": torch.get_num_threads(), "rows": []}
    active_bytes = k * 3 * i * h * (0.5 + 4 / g)  # 4-bit codes + fp16 scale and zero per group, per token
    gen = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        x = torch.randn(b, h, generator=gen).to(torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(b, e, generator=gen), -1).topk(k, -1)

        def step(x: torch.Tensor = x, weights: torch.Tensor = weights, ids: torch.Tensor = ids) -> None:
            y = x
            for w13, w2 in layers:
                y = ops.fused_moe(y, w13, w2, weights, ids)

        step()
        per_layer_ms = 1e3 * _median_s(step, repeats) / num_layers
        distinct = len(torch.unique(ids))
        row = {"batch": b, "ms_per_layer": per_layer_ms, "experts_touched": distinct,
               "weight_gb_per_s": distinct * 3 * i * h * (0.5 + 4 / g) / (per_layer_ms * 1e6),
               "cpu_half_tok_per_s": b * 1e3 / (per_layer_ms * host_layers)}
        gpu_layers = s["layers"] - host_layers
        gpu_ms = (gpu_layers * min(e, b * k) / k * active_bytes + s["layers"] * s["attention_bytes"]) / (
            gpu_gbps * 1e6)
        transfers_ms = host_layers * 2 * pcie_us / 1e3
        row["estimated_gpu_half_ms"] = gpu_ms
        row["estimated_tok_per_s"] = b * 1e3 / (per_layer_ms * host_layers + gpu_ms + transfers_ms)
        out["rows"].append(row)
        print(f"batch {b:2d}: {per_layer_ms:7.2f} ms per Qwen3-30B-A3B MoE layer on the CPU ({kind}, "
              f"{row['weight_gb_per_s']:.1f} GB/s of expert weights); {host_layers} host layers -> "
              f"{row['cpu_half_tok_per_s']:.1f} tok/s for the CPU half; with the GPU half estimated "
              f"({gpu_ms:.2f} ms + {transfers_ms:.2f} ms PCIe): {row['estimated_tok_per_s']:.1f} tok/s", flush=True)
    out.update({"host_layers": host_layers, "gpu_gbps_assumed": gpu_gbps, "pcie_us_assumed": pcie_us})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-half", action="store_true", help="time Qwen3-30B-A3B-shaped host-resident MoE layers")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="--cpu-half: MoE layers built and timed")
    p.add_argument("--host-layers", type=int, default=24,
                   help="--cpu-half: host-resident layers assumed (24: what a 12 GB card needs, engine/memory.py)")
    p.add_argument("--gpu-gbps", type=float, default=216.0)
    p.add_argument("--pcie-us", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    if args.cpu_half:
        result = {**meta, "cpu_half": cpu_half(args.layers, args.host_layers, args.batch_sizes, args.repeats,
                                               args.gpu_gbps, args.pcie_us)}
    else:
        result = {**meta, "model": SMALL, "decode": decode_vs_transformers(args.batch_sizes, args.decode_tokens,
                                                                           args.repeats)}
    out = Path(args.out or RESULTS / ("moe_cpu_half.json" if args.cpu_half else "moe_cpu.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
