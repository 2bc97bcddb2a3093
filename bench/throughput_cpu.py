"""CPU throughput: lightinfer's continuous batching against transformers ``generate``.

64 mixed-length prompts on SmolLM2-135M-Instruct (fp32), each generating the same number of new
tokens (``ignore_eos`` / ``min_new_tokens``), measured in one run:

  * lightinfer: all prompts submitted at once to ``LLM.generate``;
  * transformers, one prompt at a time (on a subset: its rate does not depend on the count);
  * transformers, one left-padded static batch of all prompts.

Writes ``bench/results/throughput_cpu.json``. Target (issue 2): lightinfer >= 2x the static batch.

    python bench/throughput_cpu.py [--num-prompts 64] [--max-tokens 64] [--serial-subset 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from lightinfer import LLM, SamplingParams
from lightinfer.loader import _read_gguf, resolve_model_path

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "an", "were", "are", "which", "this", "be", "has", "or", "had", "first", "one", "their", "its", "new", "after", "who", "they", "have", "her", "she", "two", "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up", "such", "used", "many"]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of 8..256 words, deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 256))) for _ in range(n)]


def hf_model() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config, tensors = _read_gguf(str(resolve_model_path("smollm2-135m-instruct")))
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serial-subset", type=int, default=8, help="prompts timed one at a time through HF")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads (all runs)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "throughput_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    prompts = make_prompts(args.num_prompts)
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=1024)
    tok = llm.tokenizer
    n_new = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours_s = time.perf_counter() - t
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"lightinfer: {ours_tokens} tokens in {ours_s:.1f} s = {ours_tokens / ours_s:.1f} tok/s", flush=True)

    model = hf_model()
    gen = {"do_sample": False, "max_new_tokens": n_new, "min_new_tokens": n_new, "pad_token_id": tok.eos_token_id}
    t = time.perf_counter()
    serial_tokens = 0
    with torch.no_grad():
        for p in prompts[: args.serial_subset]:
            ids = tok(p, return_tensors="pt")
            serial_tokens += model.generate(**ids, **gen).shape[1] - ids["input_ids"].shape[1]
    serial_s = time.perf_counter() - t
    print(f"transformers one at a time: {serial_tokens / serial_s:.1f} tok/s ({args.serial_subset} prompts)", flush=True)

    tok.padding_side = "left"
    t = time.perf_counter()
    with torch.no_grad():
        batch = tok(prompts, return_tensors="pt", padding=True)
        out = model.generate(**batch, **gen)
    static_s = time.perf_counter() - t
    static_tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
    print(f"transformers static batch: {static_tokens / static_s:.1f} tok/s", flush=True)

    result = {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32)",
        "num_prompts": len(prompts), "new_tokens_per_prompt": n_new,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "lightinfer_tok_s": ours_tokens / ours_s,
        "hf_serial_tok_s": serial_tokens / serial_s, "hf_serial_prompts_timed": args.serial_subset,
        "hf_static_batch_tok_s": static_tokens / static_s,
        "ratio_vs_static_batch": (ours_tokens / ours_s) / (static_tokens / static_s),
        "ratio_vs_serial": (ours_tokens / ours_s) / (serial_tokens / serial_s),
        "target_ratio_vs_static_batch": 2.0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
