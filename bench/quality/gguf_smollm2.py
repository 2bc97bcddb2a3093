"""The embedded SmolLM2 GGUF run 4-bit from the file: memory of ``LLM("smollm2-135m-instruct")`` and
greedy chat parity with transformers running the same GGUF dequantized to fp32.

    python -m bench.quality.gguf_smollm2 [--out-dir bench/results] [--max-tokens 32]

Memory: a fresh process per measurement (peak RSS is a process high-water mark): ``weight_bytes``
(what the model holds, from ``model_info()``), the peak RSS of the whole start-up, and the start-up
time (noise on a shared machine). Parity: 8 chat prompts, greedy, ``--max-tokens`` tokens, token ids
compared one to one. Writes ``gguf_smollm2.json``. The "before" figures are those of the fp32 load
(commit 18da89c: transformers dequantized the whole file to fp32) measured the same way on this
machine; pass ``--before FILE`` to replace them with a run of that code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.common.results import RESULTS

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
]
# The fp32 load (transformers' GGUF reader, every tensor dequantized), measured with _MEMORY below on
# 2 shared cores before this change.
BEFORE = {"weight_bytes": 538_060_032, "peak_rss_bytes": 2_650_169_344, "load_s": 49.4}

_MEMORY = """
import json, resource, time
t = time.perf_counter()
from lightinfer import LLM
llm = LLM("smollm2-135m-instruct")
info = llm.llm_engine.model_info()
print(json.dumps({"weight_bytes": info["weight_bytes"], "weights": info["weights"],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "load_s": time.perf_counter() - t}))
"""


def measure_memory() -> dict:
    """``LLM("smollm2-135m-instruct")`` in a fresh process: weight bytes, peak RSS, start-up seconds."""
    proc = subprocess.run([sys.executable, "-c", _MEMORY], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def chat_parity(max_tokens: int) -> dict:
    """Greedy token ids of lightinfer (W4 from the GGUF) and transformers (same GGUF, fp32) per chat prompt."""
    import torch

    from bench.common.peer_install import embedded_gguf
    from bench.quality.format_gguf import gguf_reference_model
    from lightinfer import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=1024)
    hf = gguf_reference_model(embedded_gguf())
    im_end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    rows = []
    for chat, out in zip(CHATS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              eos_token_id=im_end, pad_token_id=im_end)[0, ids.shape[1]:].tolist()
        ours = out.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        rows.append({"prompt": chat, "identical": ours == ref, "first_difference": first_diff,
                     "lightinfer": out.outputs[0].text})
    return {"max_tokens": max_tokens, "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--before", default=None, help="JSON with weight_bytes / peak_rss_bytes / load_s of the old load")
    args = p.parse_args(argv)
    before = json.loads(Path(args.before).read_text()) if args.before else BEFORE
    after = measure_memory()
    result = {
        "memory": {"before_fp32_load": before, "after_w4_from_gguf": after,
                   "weight_ratio": after["weight_bytes"] / before["weight_bytes"],
                   "peak_rss_ratio": after["peak_rss_bytes"] / before["peak_rss_bytes"]},
        "parity": chat_parity(args.max_tokens),
        "conditions": "CPU, fp32 activations, 2 cores shared with other work (times are noise)",
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf_smollm2.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["memory"]
    print(f"weights {after['weight_bytes'] / 2**20:.1f} MiB ({m['weight_ratio']:.3f} of the fp32 load), peak RSS "
          f"{after['peak_rss_bytes'] / 2**20:.0f} MiB ({m['peak_rss_ratio']:.2f} of before); greedy chat parity "
          f"{result['parity']['identical']}/{result['parity']['prompts']} at {args.max_tokens} tokens")
    return result


if __name__ == "__main__":
    main()
