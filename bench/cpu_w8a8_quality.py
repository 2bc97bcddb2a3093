"""What int8 activations would cost on the CPU: fbgemm's dynamic int8 linear in place of every GEMM.

On a CPU without AVX-512 torch's int4 GEMM is no faster than fp32 at 16 rows, while fbgemm's
``quantized::linear_dynamic`` (int8 weights per output channel, activations quantized per *tensor* on the
fly) is 2-3x faster (``bench/results/cpu_gemm_avx2.md``). This measures its quality cost on the embedded
SmolLM2 GGUF, against the exact fp32 path of the same engine and the default low-bit path (``lowbit``: int4
GEMM with bf16 activations, per-row int8 LM head), in one run. Each other mode replaces the fp32 path's
prepacked GEMM (``lightinfer.layers.cpu_gemm.PackedWeight``: every linear and the LM head when
``dtype="float32"``) with an fbgemm one:

* ``tensor``: activations per tensor, 7-bit (``reduce_range``, which AVX2's int16 pair sums need);
* ``row``: each row divided by its own absolute maximum first and multiplied back after, so the per-tensor
  scale is in effect one scale per row (llama.cpp quantizes activations per block of 32);
* ``row-w7``: as ``row`` with 8-bit activations and weights limited to 7 bits (no int16 saturation);
* ``smooth`` (``--alpha``): SmoothQuant's per-input-channel migration ``s = max|x|^a / max|W|^(1-a)``
  computed from the calibration text (2,048 tokens, the exact path's activations), W scaled by ``s`` before
  its int8 quantization and x divided by it.

Prints and writes ``bench/results/cpu_w8a8_quality.{json,md}``: held-out perplexity (``lightinfer.evaluate``,
8,192 tokens, 1,024-token windows) and ms per decode step at 1 and 16 sequences (64 greedy tokens, best of
2). Usage: ``python bench/cpu_w8a8_quality.py`` (all modes, each in its own process, ~6 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.install import cpu_flags  # bench/ is not a package: its folder goes on the path first

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results"
MODES = [("exact", 0.0), ("lowbit", 0.0), ("tensor", 0.0), ("row", 0.0), ("row-w7", 0.0), ("smooth", 0.3),
         ("smooth", 0.5), ("smooth-w7", 0.3), ("smooth-w7", 0.5)]


class Fbgemm:
    """``PackedWeight``'s interface with fbgemm's dynamic int8 linear; calibrates first when asked."""

    mode = "tensor"
    alpha = 0.0
    calibrating = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().float().clone()
        self.amax: torch.Tensor | None = None  # per input channel, from the calibration pass
        self.smooth: torch.Tensor | None = None
        self.packed = None

    def _pack(self) -> None:
        w = self.weight
        if self.alpha > 0 and self.amax is not None:
            wmax = w.abs().amax(0).clamp(min=1e-5)
            self.smooth = (self.amax.clamp(min=1e-5) ** self.alpha / wmax ** (1 - self.alpha)).clamp(min=1e-5)
            w = w * self.smooth
        levels = 63 if self.mode.endswith("w7") else 127
        s = (w.abs().amax(1) / levels).clamp(min=1e-12).double()
        qw = torch.quantize_per_channel(w, s, torch.zeros_like(s, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.weight = None  # only the packed int8 copy stays

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self.calibrating:
            m = x2.abs().amax(0)
            self.amax = m if self.amax is None else torch.maximum(self.amax, m)
            y = x2 @ self.weight.t()
        else:
            if self.packed is None:
                self._pack()
            if self.smooth is not None:
                x2 = x2 / self.smooth
            if self.mode == "tensor":
                y = torch.ops.quantized.linear_dynamic(x2, self.packed, True)
            else:
                r = x2.abs().amax(-1, keepdim=True).clamp(min=1e-12)
                y = torch.ops.quantized.linear_dynamic(x2 / r, self.packed, not self.mode.endswith("w7")) * r
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features


def run_mode(mode: str, alpha: float) -> dict:
    """One mode in this process: perplexity and decode-step times."""
    from lightinfer import LLM, SamplingParams
    from lightinfer.evaluate import perplexity
    from lightinfer.quant.calib import get_text

    if mode not in ("exact", "lowbit"):
        Fbgemm.mode, Fbgemm.alpha = mode, alpha
        for name in ("lightinfer.layers.linear", "lightinfer.layers.weight_forms", "lightinfer.layers.embed_head"):
            __import__(name)
            sys.modules[name].PackedWeight = Fbgemm
    llm = LLM(MODEL, dtype="auto" if mode == "lowbit" else "float32")
    if alpha > 0:
        ids = llm.tokenizer(get_text(None, "calib"), add_special_tokens=False)["input_ids"][:2048]
        Fbgemm.calibrating = True
        llm.generate([{"prompt_token_ids": ids[i:i + 512]} for i in range(0, len(ids), 512)],
                     SamplingParams(max_tokens=1), use_tqdm=False)
        Fbgemm.calibrating = False
    ppl = perplexity(llm=llm, max_tokens=8192, window=1024)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    step_ms = {}
    for n in (1, 16):
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            llm.generate([f"Tell me fact number {i} about cats." for i in range(n)], sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        step_ms[n] = round(best / 64 * 1000, 1)
    return {"mode": mode, "alpha": alpha, "perplexity": round(ppl.ppl, 4), "ms_per_step_1": step_ms[1],
            "ms_per_step_16": step_ms[16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=2, metavar=("MODE", "ALPHA"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_mode(args.one[0], float(args.one[1]))))
        return
    rows = []
    for mode, alpha in MODES:
        out = subprocess.run([sys.executable, __file__, "--one", mode, str(alpha)], capture_output=True, text=True,
                             check=False, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if out.returncode != 0:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    exact = rows[0]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    md = ["# int8 activations on the CPU: quality and speed (fbgemm dynamic int8 linear)", "",
          (f"Taken {when} on {cpu} ({isa}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{MODEL} GGUF; exact: the fp32 path, lowbit: the default (int4 GEMM, bf16 activations), the "
          "others: every GEMM of the fp32 path replaced. Perplexity: 8,192 held-out tokens, 1,024-token "
          "windows. ms per step: best of 2, one run, noisy."), "",
          "| mode | alpha | perplexity | vs exact | ms per step, 1 seq | ms per step, 16 seqs |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['mode']} | {r['alpha']} | {r['perplexity']:.4f} | "
                  f"{r['perplexity'] / exact['perplexity'] - 1:+.2%} | {r['ms_per_step_1']} | {r['ms_per_step_16']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_w8a8_quality.json").write_text(json.dumps({"taken": when, "isa": isa, "rows": rows}, indent=1))
    (RESULTS / "cpu_w8a8_quality.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
