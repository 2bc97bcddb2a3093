"""What every ``lightinfer`` subcommand shares: the help format and the engine's flags."""

from __future__ import annotations

import argparse
from typing import Any

# kernels.switches.CPU_W4_NAMES, spelled out: importing lightinfer.kernels imports torch, which --help must not wait
# for (tests/test_cli.py checks that the two agree)
CPU_W4_NAMES = ("c", "int8", "torch")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: "(default: X)" is added unless the text already says
    what the default is (for defaults that are computed, e.g. "default: automatic")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return super()._get_help_string(action)


def add_parser(subparsers: Any, name: str, summary: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand with a one-line ``summary`` (shown in ``lightinfer --help``) and the default-showing help."""
    return subparsers.add_parser(name, help=summary, description=description or summary,
                                 formatter_class=HelpFormatter)


def add_engine_args(p: argparse.ArgumentParser, kv_cache_dtype: str | None = "auto") -> None:
    """The :class:`lightinfer.config.EngineConfig` flags every command that starts an engine takes
    (``kv_cache_dtype=None``: the command resolves it, int8 on a GPU and auto on a CPU)."""
    p.add_argument("--dtype", default="auto",
                   help="activations: auto, float32, float16 or bfloat16 (auto: on a CPU bfloat16 for a 4-/8-bit "
                        "model, whose weights then stay low-bit, float32 for a dense one; bfloat16 or float16 on "
                        "GPUs)")
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU), cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's, at most 8192)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default=kv_cache_dtype,
                   help="KV cache storage: auto (the model's dtype) or int8 (per-token scales; a fraction of the memory)"
                        + ("" if kv_cache_dtype else " (default: int8 on a GPU, auto on a CPU)"))
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one engine step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory the engine may plan with")
    p.add_argument("--max-vram", default=None,
                   help="cap on GPU memory, e.g. 8GiB, to plan as on a smaller card (default: no cap)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size, e.g. 512MiB (default: automatic; 512MiB on CPU)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of shared prompt prefixes")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every forward eagerly: no CUDA graphs on a GPU, no replayed decode steps on a CPU")
    p.add_argument("--cpu-experts", type=int, default=0, metavar="N",
                   help="MoE models: keep the experts of the first N MoE layers in host memory and compute them on "
                        "the CPU, so a model larger than the GPU fits (the start-up log says which N a 12 GB card "
                        "needs; 0: all experts on the device)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="most prompt tokens one request computes per step, so requests behind a long prompt are not "
                        "held for its whole prefill; 0: no cap (default: 512 on a CPU, no cap on a GPU)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: with one, the same prompts give the same output every run (default: random, "
                        "drawn from the OS at start; an API request's own seed still applies)")
    p.add_argument("--threads", type=_threads, default="auto", metavar="N|auto",
                   help="CPU threads for the engine's computation. auto (default): $OMP_NUM_THREADS when set, else "
                        "the cores this process may use, fewer while other processes keep some of them busy "
                        "(measured as it serves, so threads never wait for a core another process holds); a "
                        "number fixes the count")
    p.add_argument("--cpu-lowbit", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU engines: keep 4-/8-bit layers low-bit (--cpu-lowbit) or dequantize them once for the "
                        "exact fp32 path (--no-cpu-lowbit: 4-8x the weights' memory; --dtype auto then means "
                        "float32) (default: $LIGHTINFER_CPU_LOWBIT, else low-bit)")
    p.add_argument("--cpu-w4", choices=CPU_W4_NAMES, default=None,
                   help="CPU engines: the product of 4-bit layers: c (activations int16 per block of 32), int8 "
                        "(activations int8 per block of 32: faster, a little less exact) or torch (torch's int4 "
                        "GEMM, bf16 activations) (default: $LIGHTINFER_CPU_W4, else c)")
    p.add_argument("--speculative-config", default=None, metavar="JSON|FILE",
                   help="speculative decoding, as vLLM spells it: a JSON object or a JSON file, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. Methods: ngram (prompt lookup: "
                        "drafts copied from the prompt and output so far; keys prompt_lookup_min, prompt_lookup_max) "
                        "and suffix (the likeliest continuation over this request and recent requests' outputs; keys "
                        "suffix_decoding_max_tree_depth, suffix_decoding_max_cached_requests, "
                        "suffix_decoding_min_token_prob); num_speculative_tokens 1-16 for both. Greedy output is "
                        "unchanged; the engine drafts only while its measured step times say it is faster "
                        "(default: off)")
    p.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                   help="generate (text) or pooling (an embedding model: /v1/embeddings, LLM.embed; it generates "
                        "nothing). auto: pooling when the model says it is one (a sentence-transformers "
                        "modules.json with a Pooling module, or no LM head), else generate")


def _threads(value: str) -> int | str:
    """``--threads``: ``auto`` or a positive count."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads or 'auto', got {value!r}")
    return count


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from the flags of :func:`add_engine_args` (and generate's --dummy-weights and
    --quantization, where present)."""
    return {
        "dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
        "kv_cache_dtype": args.kv_cache_dtype, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_vram": args.max_vram,
        "kv_cache_memory_bytes": args.kv_cache_memory, "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "cpu_experts": getattr(args, "cpu_experts", 0),
        "threads": getattr(args, "threads", "auto"),
        "seed": getattr(args, "seed", None),
        "long_prefill_token_threshold": getattr(args, "long_prefill_token_threshold", None),
        "cpu_lowbit": getattr(args, "cpu_lowbit", None),
        "cpu_w4": getattr(args, "cpu_w4", None),
        "speculative_config": getattr(args, "speculative_config", None),
        "runner": getattr(args, "runner", "auto"),
        "load_format": "dummy" if getattr(args, "dummy_weights", False) else "auto",
        "quantization": getattr(args, "quantization", None),
    }
