"""The ``lightinfer quantize`` and ``lightinfer eval-ppl`` subcommands.

``lightinfer/cli.py`` calls :func:`register` with its argparse subparsers; each subcommand
sets ``func`` (``args -> exit code``). Bad input is reported as one ``error:`` line on stderr
with exit code 2 (no traceback); an interrupt exits with 130 after the partial output has
been removed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _fail(cmd: str, e: BaseException) -> int:
    print(f"lightinfer {cmd}: error: {e}", file=sys.stderr)
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
                         max_tokens=args.max_tokens, window=args.window, **options)
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
    q = subparsers.add_parser(
        "quantize", help="quantize a model to W4A16 (AWQ or RTN), compressed-tensors or AutoAWQ format",
        description="Quantize a model to 4-bit weights (AWQ or RTN) and write a compressed-tensors (default) or "
                    "AutoAWQ-format checkpoint.",
    )
    q.add_argument("src", help="Hugging Face folder, .gguf file or smollm2-135m-instruct")
    q.add_argument("--out", required=True, help="output folder (must be empty or absent unless --force)")
    q.add_argument("--method", default="awq", choices=["awq", "rtn"], help="awq (default) or rtn")
    q.add_argument("--w-bit", type=_int_arg, default=4, help="weight bits (only 4)")
    q.add_argument("--group-size", default="auto", help="auto (default), 128, 64 or 32")
    q.add_argument("--calib", default=None, help=".txt or .jsonl (field 'text'); default: built-in Python docs prose")
    q.add_argument("--num-samples", type=_int_arg, default=16, help="calibration sequences (default 16)")
    q.add_argument("--seq-len", type=_int_arg, default=512, help="tokens per calibration sequence (default 512)")
    q.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    q.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "awq"],
                   help="checkpoint format: compressed-tensors (default; vLLM/SGLang native) or awq (AutoAWQ gemm)")
    q.add_argument("--force", action="store_true", help="replace a non-empty --out")
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q.set_defaults(func=run_quantize)

    e = subparsers.add_parser(
        "eval-ppl", help="perplexity on held-out text through the engine",
        description="Perplexity over non-overlapping windows, computed by the engine's own forward path.",
    )
    e.add_argument("model", help="Hugging Face folder (quantized or not), .gguf file or smollm2-135m-instruct")
    e.add_argument("--text", default=None, help=".txt or .jsonl (field 'text'); default: built-in held-out text")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    e.add_argument("--max-tokens", type=_int_arg, default=None, help="score at most N tokens of the text")
    e.add_argument("--window", type=_int_arg, default=1024, help="tokens per window (default 1024)")
    e.add_argument("--device", default=None)
    e.add_argument("--dtype", default=None)
    e.set_defaults(func=run_eval_ppl)
