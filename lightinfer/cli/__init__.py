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


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the package's ``__version__``
    (a checkout run without installing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightinfer")
    except PackageNotFoundError:
        from lightinfer import __version__

        return __version__


class _VersionAction(argparse.Action):
    """``--version``: print ``lightinfer X.Y.Z`` and exit 0. The version is looked up only when the flag is
    given, so building the parser (every ``--help``) does not read the installed metadata."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"lightinfer {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand. Subcommand modules import torch, transformers, gradio and
    the engine only inside their command functions, so ``--help`` and ``--version`` answer at once."""
    from lightinfer.cli import chat, fit, generate, quantize, serve
    from lightinfer.cli.common import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="lightinfer", formatter_class=HelpFormatter,
        description="lightinfer: quantization-first LLM inference. `lightinfer COMMAND --help` lists a command's flags.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-V", "--version", action=_VersionAction, help="print lightinfer's version and exit")
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
