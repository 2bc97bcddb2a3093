"""The lightinfer command: bad input exits 2 with one line, before any model loads."""

from __future__ import annotations

import socket
import time

import pytest

import lightinfer.llm  # noqa: F401  -- torch & co. once here: the timing below is the command's, not their import's
from lightinfer.cli import main


@pytest.mark.parametrize("argv, message", [
    (["generate", "/nonexistent", "--prompt", "hi"], "no such file or folder"),
    (["generate", "smollm2-135m-instruct", "--prompt", ""], "the prompt is empty"),
    (["serve", "smollm2-135m-instruct", "--port", "99999"], "is not a TCP port"),
    (["generate", "smollm2-135m-instruct", "--prompt", "hi", "--device", "tpu"], "'tpu' is not a device name"),
    (["generate", "smollm2-135m-instruct", "--prompt", "hi", "--device", "mps"], "runs on cpu or cuda"),
    (["serve", "smollm2-135m-instruct", "--ui-auth", "nocolon"], "--ui-auth must be USER:PASS"),
])
def test_bad_input_is_one_line_and_fast(capsys, argv: list[str], message: str) -> None:
    t = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert time.perf_counter() - t < 10  # refused before a model is loaded


def test_busy_port_is_refused_before_loading(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "smollm2-135m-instruct", "--port", str(port)]) == 2
    assert "choose another port with --port" in capsys.readouterr().err


def test_every_subcommand_and_flag_is_described_with_its_default() -> None:
    """``lightinfer COMMAND --help`` explains every flag and shows its default; ``lightinfer --help`` gives
    each command one line."""
    import argparse

    from lightinfer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {a.dest: a.help for a in sub._choices_actions}
    assert set(summaries) == {"generate", "chat", "quantize", "eval-ppl", "fit", "serve", "demo"}
    for name, command in sub.choices.items():
        assert summaries[name] and "\n" not in summaries[name], name
        assert command.description, name
        formatter = command.formatter_class(prog=command.prog)
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help text"
            if action.option_strings:
                shown = formatter._get_help_string(action) % {"default": action.default}
                assert "default" in shown, f"{name} {action.option_strings[0]} does not show its default: {shown}"
    assert "--port PORT           TCP port (default: 7860)" in sub.choices["demo"].format_help()
    assert "(default: 256)" in sub.choices["generate"].format_help()  # --max-tokens


def test_a_reader_that_goes_away_ends_the_output_quietly() -> None:
    """``lightinfer fit ... | head -2``: when the pipe closes before the table is written, the command stops
    with SIGPIPE's exit status and no traceback (it printed ``BrokenPipeError`` before)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "lightinfer.cli", "fit", "smollm2-135m-instruct",
                             "--vram", "8GiB,12GiB,24GiB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written (the import alone takes seconds)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_version_prints_the_installed_version(capsys) -> None:
    from importlib.metadata import version

    import lightinfer

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"lightinfer {version('lightinfer')}\n"
    assert lightinfer.__version__ == version("lightinfer")  # pyproject.toml and the package agree


def test_help_and_version_import_no_heavy_module() -> None:
    """``lightinfer --help`` took ~3 s: the package and the subcommand modules imported torch, transformers and
    the engine before parsing. Now the commands import them when they run; checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from lightinfer.cli import build_parser\n"
            "parser = build_parser()\n"
            "for argv in (['--help'], ['--version'], ['serve', '--help'], ['generate', '--help']):\n"
            "    try:\n"
            "        parser.parse_args(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'gradio', 'numpy', 'lightinfer.llm') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_the_cli_offers_the_cpu_products_the_kernels_know() -> None:
    from lightinfer.cli.common import CPU_W4_NAMES
    from lightinfer.kernels.switches import CPU_W4_NAMES as KERNEL_NAMES

    assert CPU_W4_NAMES == KERNEL_NAMES


def test_the_package_still_exports_its_api_lazily() -> None:
    import lightinfer

    assert lightinfer.SamplingParams.__module__ == "lightinfer.sampling_params"
    assert {"LLM", "pipeline", "StructuredOutputs"} <= set(dir(lightinfer))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightinfer.nope  # noqa: B018
