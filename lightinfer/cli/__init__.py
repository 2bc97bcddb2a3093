"""The ``lightinfer`` command: generate, chat, quantize, eval-ppl, fit, serve and demo.

Each subcommand lives in its own module (``generate``, ``chat``, ``quantize``, ``fit``, ``serve``) with a
``register(subparsers)`` that sets ``func(args) -> exit code``; :func:`main` turns bad input into
one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from lightinfer.cli import chat, fit, generate, quantize, serve
    from lightinfer.cli.common import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="lightinfer", formatter_class=HelpFormatter,
        description="lightinfer: quantization-first LLM inference. `lightinfer COMMAND --help` lists a command's flags.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.register(sub)
    chat.register(sub)
    quantize.register(sub)  # quantize, eval-ppl
    fit.register(sub)
    serve.register(sub)  # serve, demo
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
    except BrokenPipeError:
        # the reader went away (`lightinfer fit ... | head`): stop quietly, as a tool killed by SIGPIPE does;
        # stdout points at /dev/null so that the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
