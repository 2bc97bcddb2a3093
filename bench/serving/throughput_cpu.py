"""CPU throughput: lightinfer's continuous batching against transformers ``generate``.

64 mixed-length prompts on SmolLM2-135M-Instruct, measured in one run: lightinfer as ``--dtype`` says
(default auto: on a CPU bf16 activations with the 4-/8-bit weights kept low-bit; ``float32``: the exact
dequantized path), transformers in fp32 from the same GGUF. ``--mode fixed``:
random-word prompts that all generate exactly ``--max-tokens`` (``ignore_eos`` /
``min_new_tokens``); ``--mode eos``: chat requests that stop at EOS, only the tokens up to each
EOS counted (a static batch keeps computing until its longest member is done):

  * lightinfer: all prompts submitted at once to ``LLM.generate``;
  * transformers, one prompt at a time (on a subset: its rate does not depend on the count);
  * transformers, one left-padded static batch of all prompts.

Writes ``bench/results/throughput_cpu.json`` (``throughput_cpu_eos.json`` with ``--mode eos``). Target (issue 2):
lightinfer >= 2x the static batch. lightinfer runs through its public API (``LLM``, ``llm_engine.get_stats()``);
transformers gets the GGUF dequantized by its own reader (``bench.quality.format_gguf.gguf_reference_model``).

    python -m bench.serving.throughput_cpu [--num-prompts 64] [--max-tokens 64] [--serial-subset 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from bench.common.peer_install import embedded_gguf
from bench.common.results import RESULTS, write_json
from lightinfer import LLM, SamplingParams

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "an", "were", "are", "which", "this", "be", "has", "or", "had", "first", "one", "their", "its", "new", "after", "who", "they", "have", "her", "she", "two", "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up", "such", "used", "many"]


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of 8..256 words, deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 256))) for _ in range(n)]


TASKS = ("Write a haiku about {t}.", "List {n} facts about {t}.", "Explain {t} to a child in detail.",
         "Say hello.", "Write a short story about {t}.", "What is {t}? Answer in one word.",
         "Give {n} tips for learning about {t}.", "Write a long essay about {t}.")
TOPICS = ("the sea", "volcanoes", "Paris", "bread", "the moon", "trains", "music", "cats", "rain", "chess")


def make_chat_prompts(tokenizer: object, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` chat-templated requests whose answers end (EOS) at very different lengths."""
    from lightinfer.inputs import render_chat

    rng = random.Random(seed)
    return [render_chat(tokenizer, [{"role": "user", "content": rng.choice(TASKS).format(
        t=rng.choice(TOPICS), n=rng.randint(2, 9))}]).prompt_token_ids for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serial-subset", type=int, default=8, help="prompts timed one at a time through HF")
    ap.add_argument("--mode", choices=("fixed", "eos"), default="fixed",
                    help="fixed: random-word prompts, every output exactly --max-tokens long (ignore_eos); "
                         "eos: chat requests that stop at EOS (at most --max-tokens), only real tokens counted")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads (all runs)")
    ap.add_argument("--kv-cache-bytes", default="1GiB", help="lightinfer's KV pool (default 1GiB)")
    ap.add_argument("--dtype", default="auto",
                    help="lightinfer's dtype: auto (on a CPU: bf16 activations, the GGUF's 4-/8-bit weights kept "
                         "low-bit, as `lightinfer serve` runs it) or float32 (the exact dequantized path)")
    ap.add_argument("--out", default=None, help="default: bench/results/throughput_cpu[_eos].json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    # A KV pool that holds the whole workload (as transformers' static batch holds its ~0.9 GiB
    # cache): the CPU default of 512 MiB would make the engine preempt and recompute.
    llm = LLM("smollm2-135m-instruct", dtype=args.dtype, max_model_len=1024, threads=args.threads,
              kv_cache_memory_bytes=args.kv_cache_bytes, show_progress=False)
    tok = llm.tokenizer
    eos_mode = args.mode == "eos"
    prompts = make_chat_prompts(tok, args.num_prompts) if eos_mode else make_prompts(args.num_prompts)
    n_new = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=not eos_mode)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    ours_s = time.perf_counter() - t
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"lightinfer: {ours_tokens} tokens in {ours_s:.1f} s = {ours_tokens / ours_s:.1f} tok/s", flush=True)

    from bench.quality.format_gguf import gguf_reference_model

    model = gguf_reference_model(embedded_gguf())
    eos = tok.eos_token_id
    gen = {"do_sample": False, "max_new_tokens": n_new, "pad_token_id": eos, "eos_token_id": eos}
    if not eos_mode:
        gen["min_new_tokens"] = n_new

    def useful(new_ids: torch.Tensor) -> int:
        """Generated tokens up to and including the first EOS (what a user receives)."""
        ids = new_ids.tolist()
        return ids.index(eos) + 1 if eos_mode and eos in ids else len(ids)

    def encode(p: str | list[int]) -> dict:
        if isinstance(p, str):
            return tok(p, return_tensors="pt")
        return {"input_ids": torch.tensor([p]), "attention_mask": torch.ones(1, len(p), dtype=torch.long)}

    t = time.perf_counter()
    serial_tokens = 0
    with torch.no_grad():
        for p in prompts[: args.serial_subset]:
            ids = encode(p)
            serial_tokens += useful(model.generate(**ids, **gen)[0, ids["input_ids"].shape[1]:])
    serial_s = time.perf_counter() - t
    print(f"transformers one at a time: {serial_tokens / serial_s:.1f} tok/s ({args.serial_subset} prompts)", flush=True)

    tok.padding_side = "left"
    t = time.perf_counter()
    with torch.no_grad():
        if eos_mode:
            batch = tok.pad({"input_ids": prompts}, return_tensors="pt", padding=True)
        else:
            batch = tok(prompts, return_tensors="pt", padding=True)
        out = model.generate(**batch, **gen)
    static_s = time.perf_counter() - t
    static_tokens = sum(useful(row[batch["input_ids"].shape[1]:]) for row in out)
    print(f"transformers static batch: {static_tokens / static_s:.1f} tok/s", flush=True)

    result = {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
        "lightinfer_dtype": llm.llm_engine.model_info()["dtype"],
        "hf_dtype": "float32 (dequantized)",
        "mode": args.mode, "num_prompts": len(prompts), "max_new_tokens_per_prompt": n_new,
        "output_tokens": ours_tokens, "kv_cache_bytes": llm.llm_engine.config.kv_cache_memory_bytes,
        "preemptions": llm.llm_engine.get_stats().num_preemptions,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "lightinfer_tok_s": ours_tokens / ours_s,
        "hf_serial_tok_s": serial_tokens / serial_s, "hf_serial_prompts_timed": args.serial_subset,
        "hf_static_batch_tok_s": static_tokens / static_s,
        "ratio_vs_static_batch": (ours_tokens / ours_s) / (static_tokens / static_s),
        "ratio_vs_serial": (ours_tokens / ours_s) / (serial_tokens / serial_s),
        "target_ratio_vs_static_batch": 2.0,
    }
    write_json(Path(args.out) if args.out else RESULTS / ("throughput_cpu_eos.json" if eos_mode else "throughput_cpu.json"),
               result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
