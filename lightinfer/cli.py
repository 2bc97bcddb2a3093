"""The lightinfer command: generate, quantize, eval-ppl, serve and demo."""

from __future__ import annotations

import argparse
import logging
import sys

from lightinfer.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts an engine."""
    p.add_argument("model", help="Hugging Face folder, .gguf file, or smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, tokens")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-vram", default=None, help="cap on GPU memory, e.g. 8GiB")
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 512MiB")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--dummy-weights", action="store_true",
                   help="random weights of the model's config.json, built on the device (benchmarks; no weight files)")
    p.add_argument("--quantization", default=None, choices=["awq"],
                   help="with --dummy-weights: build 4-bit AWQ layers; otherwise: require an AWQ checkpoint")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags of :func:`add_engine_args`."""
    return {
        "dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
        "kv_cache_dtype": args.kv_cache_dtype, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_vram": args.max_vram,
        "kv_cache_memory_bytes": args.kv_cache_memory, "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager, "load_format": "dummy" if args.dummy_weights else "auto",
        "quantization": args.quantization,
    }


def _generate(args: argparse.Namespace) -> int:
    from lightinfer.llm import LLM

    prompt: str | list[int]
    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat wraps a text prompt; it does not combine with --prompt-ids")
        prompt = _parse_ids(args.prompt_ids)
    else:
        if not args.prompt:
            raise ValueError("the prompt is empty; give --prompt TEXT")
        prompt = args.prompt
        if args.dummy_weights:  # fail before building the model when there is no tokenizer to read text
            from lightinfer.loader import Checkpoint

            if not Checkpoint(args.model, read_weights=False).has_tokenizer:
                raise ValueError(f"{args.model} has no tokenizer files (a bare config with --dummy-weights), so "
                                 f"it cannot read text; give token ids instead: --prompt-ids 1,2,3")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        prompt = llm.input_processor.render_chat([{"role": "user", "content": args.prompt}])
    if llm.tokenizer is None:  # ids in, ids out
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        sys.stdout.write(" ".join(map(str, out.token_ids)) + "\n")
        return 0
    for piece in llm.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _parse_ids(text: str) -> list[int]:
    """``"1,2, 3"`` or ``"1 2 3"`` -> ``[1, 2, 3]``. Raises ValueError on anything else."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--prompt-ids takes token ids separated by commas or spaces, e.g. 1,2,3; got {text!r}")
    return [int(p) for p in parts]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_args(g)
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the prompt text")
    which.add_argument("--prompt-ids", help="the prompt as token ids, e.g. 1,2,3 (models without a tokenizer: "
                       "the output is printed as ids too)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=_generate)
    from lightinfer.entrypoints import commands as serve_commands
    from lightinfer.quant import commands as quant_commands

    quant_commands.register(sub)  # quantize, eval-ppl
    serve_commands.register(sub)  # serve, demo
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input exits 2 with a one-line error, never a traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    from lightinfer.engine.cuda_graph import CudaGraphCaptureError

    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, CudaGraphCaptureError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
