"""``lightinfer generate MODEL --prompt TEXT``: one completion, streamed to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightinfer.cli.common import add_engine_args, add_parser, engine_kwargs
from lightinfer.sampling_params import SamplingParams


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand (it sets ``func(args) -> exit code``)."""
    g = add_parser(subparsers, "generate", "generate text for one prompt, streamed to stdout")
    g.add_argument("model", help="Hugging Face folder, .gguf file, or smollm2-135m-instruct")
    add_engine_args(g)
    g.add_argument("--dummy-weights", action="store_true",
                   help="random weights of the model's config.json, built on the device (benchmarks; no weight files)")
    g.add_argument("--quantization", default=None, choices=["awq"],
                   help="with --dummy-weights: build 4-bit AWQ layers; otherwise: require an AWQ checkpoint "
                        "(default: whatever the checkpoint is)")
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the prompt text (no default: this or --prompt-ids is required)")
    which.add_argument("--prompt-ids", help="the prompt as token ids, e.g. 1,2,3 (models without a tokenizer: "
                       "the output is printed as ids too; no default: this or --prompt is required)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 = all")
    g.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Run ``lightinfer generate``; returns the exit code (errors are raised as ValueError)."""
    from lightinfer.llm import LLM

    prompt: str | list[int]
    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat wraps a text prompt; it does not combine with --prompt-ids")
        prompt = parse_ids(args.prompt_ids)
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


def parse_ids(text: str) -> list[int]:
    """``"1,2, 3"`` or ``"1 2 3"`` -> ``[1, 2, 3]``. Raises ValueError on anything else."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--prompt-ids takes token ids separated by commas or spaces, e.g. 1,2,3; got {text!r}")
    return [int(p) for p in parts]
