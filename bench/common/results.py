"""Where benchmark results go, and the facts every result records about its run.

One file per benchmark under ``bench/results/`` (``<name>.json``, and ``<name>.md`` where the benchmark
writes a table): the latest run. Earlier runs stay in git history; docs that quote them name the commit.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout
RESULTS = ROOT / "bench" / "results"
CONFIGS = ROOT / "bench" / "configs"  # config.json of published models, for dummy-weight runs


def utc_now() -> str:
    """The time now as ``YYYY-MM-DD HH:MM UTC`` (what results record as their date)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit() -> str:
    """The checkout's short commit hash, or ``"unknown"`` outside a git checkout."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def write_json(path: Path, result: Any) -> Path:
    """Write ``result`` as indented JSON (a trailing newline) to ``path``, creating its folder; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def write_result(name: str, result: Any, markdown: str | None = None, out_dir: Path = RESULTS) -> Path:
    """Write ``<out_dir>/<name>.json`` and, with ``markdown``, ``<name>.md``; returns the JSON's path."""
    if markdown is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.md").write_text(markdown)
    return write_json(out_dir / f"{name}.json", result)
