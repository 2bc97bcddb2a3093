"""The ``lightinfer quantize`` and ``lightinfer eval-ppl`` subcommands.

``lightinfer.cli`` calls :func:`register` with its argparse subparsers; each subcommand
sets ``func`` (``args -> exit code``). Bad input is reported as one ``error:`` line on stderr
with exit code 2 (no traceback); an interrupt exits with 130 after the partial output has
been removed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightinfer.cli.common import add_parser


def _fail(cmd: str, e: BaseException) -> int:
    """One ``error:`` line, as every command prints it (``cmd`` is kept for the callers' readability)."""
    print(f"error: {e}", file=sys.stderr)
    return 2


def run_quantize(args: argparse.Namespace) -> int:
    """Run ``lightinfer quantize`` from parsed arguments; returns the exit code."""
    from lightinfer.quant.api import quantize
    from lightinfer.quant.config import QuantConfig

    try:
        cfg = QuantConfig(
            w_bit=args.w_bit, group_size=args.group_size, method=args.method, calib=args.calib,
            num_samples=args.num_samples, seq_len=args.seq_len, device=args.device, format=args.format,
        )
        if args.calib and args.method == "awq":
            from lightinfer.quant.calib import read_text_file

            read_text_file(args.calib)  # an unreadable or empty file fails now, not after the model loads
        summary = quantize(args.src, args.out, cfg, force=args.force, progress=not args.quiet)
    except KeyboardInterrupt:
        return 130  # AtomicOutputDir has removed the partial output and said so
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        return _fail("quantize", e)
    print(summary.format())
    return 0


def run_eval_ppl(args: argparse.Namespace) -> int:
    """Run ``lightinfer eval-ppl``; prints the perplexity and the number of tokens scored."""
    from lightinfer.evaluate import perplexity

    try:
        options: dict[str, Any] = {}
        if args.device:
            options["device"] = args.device
        if args.dtype:
            options["dtype"] = args.dtype
        if args.text:
            from lightinfer.quant.calib import read_text_file

            read_text_file(args.text)  # fail before the model loads
        res = perplexity(args.model, text_path=args.text, kv_cache_dtype=args.kv_cache_dtype,
                         max_tokens=args.max_tokens, window=args.window, progress=not args.quiet, **options)
    except (ValueError, FileNotFoundError) as e:
        return _fail("eval-ppl", e)
    print(res.format())
    return 0


def _int_arg(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def register(subparsers: Any) -> None:
    """Add ``quantize`` and ``eval-ppl`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    q = add_parser(
        subparsers, "quantize", "quantize a model to 4-bit weights (compressed-tensors or AutoAWQ format)",
        "Quantize a model to 4-bit weights (AWQ or RTN) and write a compressed-tensors (default; what vLLM and "
        "SGLang load natively) or AutoAWQ-format checkpoint.",
    )
    q.add_argument("src", help="Hugging Face folder, .gguf file or smollm2-135m-instruct")
    q.add_argument("--out", required=True, help="output folder, must be empty or absent unless --force (required, no default)")
    q.add_argument("--method", default="awq", choices=["awq", "rtn"],
                   help="awq (activation-aware scales and clipping) or rtn (round to nearest)")
    q.add_argument("--w-bit", type=_int_arg, default=4, help="weight bits (only 4)")
    q.add_argument("--group-size", default="auto",
                   help="auto, 128, 64 or 32 (auto: the largest that divides every quantized layer's input)")
    q.add_argument("--calib", default=None,
                   help=".txt or .jsonl (field 'text') calibration text (default: built-in Python docs prose)")
    q.add_argument("--num-samples", type=_int_arg, default=16, help="calibration sequences")
    q.add_argument("--seq-len", type=_int_arg, default=512, help="tokens per calibration sequence")
    q.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is a GPU)")
    q.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "awq"],
                   help="checkpoint format: compressed-tensors (vLLM/SGLang native) or awq (AutoAWQ gemm)")
    q.add_argument("--force", action="store_true", help="replace a non-empty --out")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=run_quantize)

    e = add_parser(
        subparsers, "eval-ppl", "perplexity on held-out text through the engine",
        "Perplexity over non-overlapping windows, computed by the engine's own forward path.",
    )
    e.add_argument("model", help="Hugging Face folder (quantized or not), .gguf file or smollm2-135m-instruct")
    e.add_argument("--text", default=None,
                   help=".txt or .jsonl (field 'text') to score (default: built-in held-out text)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV cache storage: auto (the model's dtype) or int8")
    e.add_argument("--max-tokens", type=_int_arg, default=None,
                   help="score at most N tokens of the text (default: all of it)")
    e.add_argument("--window", type=_int_arg, default=None,
                   help="tokens per window (default: 2048, the windows of the quality tables in docs/performance.md, "
                        "or the model's context if shorter)")
    e.add_argument("--device", default=None, help="auto, cpu or cuda (default: auto)")
    e.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16 (default: auto)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.set_defaults(func=run_eval_ppl)
