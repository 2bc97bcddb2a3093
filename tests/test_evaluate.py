"""``eval-ppl`` (issue 19 item 9): a progress bar with the time left, and a default window that matches the
quality table of docs/performance.md (2,048 tokens; it was 1,024, which gave 16.76 where the table says 15.54)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightinfer.cli import build_parser, main
from lightinfer.evaluate import DEFAULT_WINDOW, default_window
from tests.conftest import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ppl") / "llama", max_position_embeddings=4096)


def test_the_default_window_is_the_quality_tables() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    assert DEFAULT_WINDOW == 2048 and "2,048-token windows" in doc
    import argparse

    parser = build_parser()
    assert parser.parse_args(["eval-ppl", "m"]).window is None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "(default: 2048, the windows of the quality tables in docs/performance.md" in " ".join(sub.choices["eval-ppl"].format_help().split())


def test_default_window_and_progress_bar(tiny_long: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 120)  # ~5,400 byte tokens: 3 windows
    assert main(["eval-ppl", str(tiny_long), "--text", str(text)]) == 0
    captured = capsys.readouterr()
    assert "windows of <= 2048 tokens" in captured.out
    # tqdm on stderr: the windows done of the total, the running perplexity, and the time left
    assert "perplexity" in captured.err and "/3 " in captured.err and "ppl=" in captured.err
    assert "<" in captured.err.split("/3 ")[-1]  # "[elapsed<remaining, ...]"
    assert main(["eval-ppl", str(tiny_long), "--text", str(text), "--window", "512", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "windows of <= 512 tokens" in captured.out and "ppl=" not in captured.err


def test_a_shorter_model_context_caps_the_default(tmp_path: Path) -> None:
    short = write_tiny_checkpoint(tmp_path / "short", max_position_embeddings=512)
    assert default_window(str(short)) == 512
