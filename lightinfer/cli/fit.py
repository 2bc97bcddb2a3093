"""The ``lightinfer fit`` subcommand: will a model fit these cards, and how many sequences, from its config and
tensor headers only (:func:`lightinfer.engine.fit.fit`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightinfer.cli.common import add_parser


def run_fit(args: argparse.Namespace) -> int:
    """Print the fit table (or ``--json``); bad input raises ValueError / FileNotFoundError, which
    :func:`lightinfer.cli.main` prints as one ``error:`` line with exit code 2."""
    from lightinfer.engine.fit import fit

    report = fit(args.model, vram=args.vram, max_model_len=_number("--max-model-len", args.max_model_len, int),
                 kv_cache_dtype=args.kv_cache_dtype,
                 gpu_memory_utilization=_number("--gpu-memory-utilization", args.gpu_memory_utilization, float))
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.table())
    return 0


def _number(flag: str, value: str | None, kind: type) -> int | float | None:
    """A flag's value as ``kind``; a ValueError (one ``error:`` line, exit 2) naming the flag otherwise. Range
    checks are :func:`~lightinfer.engine.fit.fit`'s, so the Python API and the command say the same."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {value!r}") from None


def register(subparsers: Any) -> None:
    """Add ``fit`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = add_parser(
        subparsers, "fit", "will a model fit a GPU? weights, KV tokens and sequences per VRAM budget",
        "For each VRAM budget: W4 + INT8 KV, W4 + fp16 KV and the checkpoint as it is, through the engine's own "
        "memory plan (weights, activation peak, CUDA graphs, CUDA context, KV pool). Reads only the config and "
        "the tensor headers: nothing is loaded, no GPU is needed. The figures are computed, not measured.",
    )
    p.add_argument("model", help="Hugging Face folder (config.json + *.safetensors, or config.json alone), "
                                 ".gguf file or smollm2-135m-instruct")
    p.add_argument("--vram", default="8GiB,12GiB,24GiB",
                   help="card sizes, comma-separated: 8GiB, 12GB, 12G, 12000MiB (GB and G count 2^30 bytes)")
    p.add_argument("--max-model-len", default=None,
                   help="tokens per sequence (default: the model's context, at most 8192, as the engine sets it)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp16"), default="auto",
                   help="KV cache of the 'as is' rows: auto (the model's 16-bit dtype), fp16 or int8")
    p.add_argument("--gpu-memory-utilization", default="0.9",
                   help="share of each card the engine plans with")
    p.add_argument("--json", action="store_true", help="print the report as JSON (bytes and token counts)")
    p.set_defaults(func=run_fit)
