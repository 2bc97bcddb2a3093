"""``lightinfer fit``: the engine's memory plan from a config and tensor headers, never tensor data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightinfer.cli import main
from lightinfer.engine.fit import fit
from lightinfer.engine.fit_weights import BUFFERS, checkpoint_plan
from lightinfer.engine.memory import GIB, cpu_experts_needed
from lightinfer.loader import Checkpoint
from lightinfer.models.registry import get_model_class
from tests.conftest import SMOLLM2, requires_smollm2, write_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"


def _rows(report: object) -> dict[tuple[float, str], object]:
    return {(r.vram_bytes / GIB, r.variant.split(" +")[0] + (" " + r.kv_cache_dtype)): r for r in report.rows}


@requires_smollm2
def _runtime_weight_bytes(model: str) -> int:
    """What an engine holds in the run-time layouts (what a GPU engine keeps): built on the reference backend,
    since the CPU backend replaces them with forms of its own (``pack_for_cpu``)."""
    from lightinfer import LLM
    from lightinfer.layers.ops import use_backend

    with use_backend("reference"):
        llm = LLM(model, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**23)
    return llm.llm_engine.model_info()["weight_bytes"]


def test_smollm2_gguf_fits_8gib_and_its_weights_are_what_the_engine_holds(smollm2_lowbit_llm) -> None:
    report = fit(SMOLLM2, vram="8GiB")
    assert [r.variant for r in report.rows] == ["W4 + INT8 KV", "W4 + fp16 KV", "as is + fp16 KV"]
    assert all(r.fits and not r.flags and r.sequences >= 20 for r in report.rows)
    assert report.max_model_len == 8192 and report.rows[2].weights.startswith("GGUF Q4_1")
    int8, fp16 = report.rows[0], report.rows[1]
    assert int8.kv_tokens > 1.8 * fp16.kv_tokens  # INT8 nearly halves the bytes per token
    # The checkpoint as it is, at the CPU engine's fp32: exactly the engine's weight bytes (the Q8_0 embedding
    # as a W8 table, Q4_1 layers as W4), less the rotary table it holds as a buffer.
    plan = checkpoint_plan(Checkpoint(SMOLLM2, read_weights=False), torch.float32)
    engine = _runtime_weight_bytes(SMOLLM2)
    assert plan.total - plan.parts[BUFFERS] == pytest.approx(engine, rel=0.02)
    assert plan.tied and plan.host_bytes(True) == 0  # a tied embedding stays on the GPU
    # A CPU engine with bf16 activations: the copies it keeps for its GEMMs are what the CPU memory check's
    # estimate predicts: the tied Q8_0 table's copy requantized per row for the LM head's int8 GEMM (its codes
    # stay for the embedding), and no 16-bit copy of it.
    engine = smollm2_lowbit_llm.llm_engine
    assert engine.model_runner.dtype == torch.bfloat16
    hf, qc = engine.checkpoint.hf_config, engine.checkpoint.quant_config
    _, cpu_dense = get_model_class(hf).estimate_weight_bytes(hf, qc, torch.bfloat16)
    per_channel = hf.vocab_size * hf.hidden_size + hf.vocab_size * 2  # int8 codes + a bf16 scale per row
    assert engine.model_info()["cpu_dense_bytes"] == cpu_dense == per_channel


def test_gptq_checkpoint_as_is_matches_the_built_engine() -> None:
    folder = FIXTURES / "gptq-4bit-g32-sym"
    plan = checkpoint_plan(Checkpoint(folder, read_weights=False), torch.float32)
    assert plan.label.startswith("gptq 4-bit g32") and plan.w4
    assert plan.total - plan.parts[BUFFERS] == pytest.approx(_runtime_weight_bytes(str(folder)), rel=0.02)


def test_tiny_safetensors_folder_and_truncated_data(tmp_path) -> None:
    folder = write_tiny_checkpoint(tmp_path / "tiny")
    report = fit(str(folder), vram=["1GiB"], max_model_len=256)
    as_is = report.rows[2]
    assert as_is.weights == "F32 safetensors" and as_is.fits and report.max_model_len == 256
    hf = Checkpoint(folder, read_weights=False).hf_config
    dense = get_model_class(hf).weight_bytes_by_part(hf, bits=16, dtype_bytes=2)
    # untied: the input embedding stays in host memory, the rest (+ the rotary table) on the GPU
    assert as_is.host_bytes == dense["embed_tokens"]
    assert as_is.weight_bytes == sum(dense.values()) - dense["embed_tokens"] + 512 * 8 * 4 * 2
    assert report.file_bytes == sum(p.numel() * 4 for p in _hf_params(folder))
    # Cut the data region short: the loader refuses the file, fit reads only the header and says the same.
    shard = folder / "model.safetensors"
    head = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    shard.write_bytes(shard.read_bytes()[: head + 16])
    with pytest.raises(ValueError, match="truncated|not fully covered"):
        Checkpoint(folder)
    assert fit(str(folder), vram=["1GiB"], max_model_len=256).rows == report.rows


def _hf_params(folder: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(folder / "model.safetensors")).values())


@requires_smollm2
def test_gguf_tensor_data_is_never_read(monkeypatch) -> None:
    from lightinfer.formats import gguf_file

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("fit read tensor data")

    monkeypatch.setattr(gguf_file.GGUFFile, "read_raw", refuse)
    monkeypatch.setattr(gguf_file.GGUFFile, "dequantize", refuse)
    monkeypatch.setattr(gguf_file.os, "pread", refuse)
    assert fit(SMOLLM2, vram="8GiB").rows[2].fits


def test_llama3_8b_w4_int8_fits_12gib_with_several_8k_sequences() -> None:
    from lightinfer.dummy_weights import dummy_awq_config
    from lightinfer.engine.memory import module_bytes

    rows = _rows(fit(str(CONFIGS / "llama-3-8b"), vram="8GiB,12GiB,24GiB"))
    w4_int8, w4_fp16, as_is = rows[12, "W4 int8"], rows[12, "W4 fp16"], rows[12, "as is fp16"]
    assert w4_int8.fits and w4_int8.sequences >= 8 and w4_int8.kv_tokens >= 8 * 8192
    assert w4_fp16.fits and w4_int8.kv_tokens > 1.8 * w4_fp16.kv_tokens
    assert not as_is.fits and as_is.weights == "bfloat16 (config only)" and "cannot fit" in as_is.note
    assert rows[24, "as is fp16"].fits
    # The W4 weights on the GPU are what the engine builds: the model with 4-bit layers on the meta device,
    # less the untied input embedding it keeps in host memory (128256 x 4096 x 2 bytes).
    hf = Checkpoint(CONFIGS / "llama-3-8b", read_weights=False).hf_config
    with torch.device("meta"):
        model = get_model_class(hf)(hf, dummy_awq_config(hf), torch.float16)
    assert w4_int8.weight_bytes == module_bytes(model, exclude=(model.embed_tokens.weight,))
    assert w4_int8.host_bytes == 128256 * 4096 * 2
    # The reserve: activation peak, CUDA graphs, CUDA context; the KV pool is the rest, in whole blocks.
    kv = w4_int8.budget_bytes - w4_int8.weight_bytes - w4_int8.reserved_bytes
    assert w4_int8.kv_tokens == kv // (w4_int8.kv_bytes_per_token * 16) * 16


def test_qwen3_moe_needs_cpu_experts_on_12gib_and_fits_24gib() -> None:
    report = fit(str(CONFIGS / "qwen3-30b-a3b"), vram="12GiB,24GiB")
    rows = _rows(report)
    w4 = rows[12, "W4 int8"]
    assert w4.fits and w4.flags.startswith("--cpu-experts ") and w4.graph_bytes == 0
    n = int(w4.flags.split()[-1])
    assert 0 < n < 48 and "first" in w4.note
    # The same answer as the engine's own advice function, with fit's reserve
    hf = Checkpoint(CONFIGS / "qwen3-30b-a3b", read_weights=False).hf_config
    per_layer = get_model_class(hf).weight_bytes_by_part(hf, bits=4, group_size=128)["experts"] // 48
    gpu_all = w4.weight_bytes + n * per_layer
    need = (report.max_model_len // 16) * 16 * w4.kv_bytes_per_token
    assert cpu_experts_needed(gpu_all, [per_layer] * 48, need, w4.budget_bytes,
                              w4.activation_bytes + w4.non_torch_bytes) == n
    # moved experts, what the CPU copy the engine makes of them adds beyond the W4 stacks it releases
    # (kernels/moe_cpu.py: fp16 activations, so torch's int4 codes plus an fp16 (scale, offset) pair per group of
    # 128: the stacks' size, nothing added), and the input embedding
    from lightinfer.kernels.moe_cpu import int4_gemm_available

    e, h, i = 128, 2048, 768
    stack = e * sum(n_out * k // 2 + 2 * (k // 128) * n_out * 2 for n_out, k in ((2 * i, h), (h, i)))
    added = 0 if int4_gemm_available() else e * 3 * h * i * 2 - stack  # else dequantized fp16
    assert stack == per_layer
    assert w4.host_bytes == n * (per_layer + added) + 151936 * 2048 * 2
    assert ("CPU GEMMs' copy adds" in w4.note) == bool(added)
    full = rows[24, "W4 int8"]
    assert full.fits and not full.flags and full.sequences >= 1 and full.graph_bytes > 0


def test_sliding_window_and_context_cap(tmp_path) -> None:
    import transformers

    cfg = transformers.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                     sliding_window=1024)
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(tmp_path / "m")
    windowed = fit(str(tmp_path / "m"), vram="1GiB")
    assert windowed.max_model_len == 4096  # the window limits what each layer keeps, not the context
    with pytest.raises(ValueError, match="exceeds what this model supports"):
        fit(str(tmp_path / "m"), vram="1GiB", max_model_len=8192)
    cfg.sliding_window = None
    cfg.save_pretrained(tmp_path / "full")
    full = fit(str(tmp_path / "full"), vram="1GiB")
    for w, f in zip(windowed.rows[:2], full.rows[:2]):  # a layer keeps at most its window (+ a step's chunk)
        assert w.fits and f.fits and w.sequences > 1.2 * f.sequences


def test_cli_table_json_and_vram_units(capsys) -> None:
    assert main(["fit", str(CONFIGS / "llama-3-8b"), "--vram", "12GB,12GiB,12G,12288MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["vram_bytes"] for r in out["rows"]} == {12 * GIB} and len(out["rows"]) == 12
    assert all(r["reserved_bytes"] == r["activation_bytes"] + r["graph_bytes"] + r["non_torch_bytes"]
               for r in out["rows"])
    assert main(["fit", str(CONFIGS / "llama-3-8b"), "--vram", "12GiB", "--kv-cache-dtype", "int8"]) == 0
    text = capsys.readouterr().out
    assert "not measured" in text and "as is + int8 KV" in text and "W4 + INT8 KV" in text


@pytest.mark.parametrize("argv, message", [
    (["/no/such/model"], "no such file or folder"),
    (["{tmp}"], "has no config.json"),
    (["{cfg}", "--vram", "twelve"], "--vram: cannot read a memory size from 'twelve'"),
    (["{cfg}", "--vram", "0GiB"], "not a positive memory size"),
    (["{cfg}", "--max-model-len", "0"], "--max-model-len must be a positive"),
    (["{cfg}", "--max-model-len", "many"], "--max-model-len: expected a number"),
    (["{cfg}", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["{foo}"], "architecture FooForCausalLM is not supported; supported: Gemma2ForCausalLM"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message) -> None:
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"],
                                                             "model_type": "llama"}))
    subs = {"{tmp}": str(tmp_path), "{cfg}": str(CONFIGS / "llama-3-8b"), "{foo}": str(tmp_path / "foo")}
    assert main(["fit", *[subs.get(a, a) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("error:") and "\n" not in err
