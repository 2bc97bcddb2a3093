"""--dummy-weights: random weights of a config alone, dense or 4-bit, ids in and ids out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from lightinfer.dummy_weights import DUMMY_STD, dummy_awq_config, init_dummy_weights
from lightinfer.kernels.reference import dequantize_w4
from lightinfer.layers.linear import Linear, W4A16Linear
from tests.conftest import write_tiny_checkpoint

BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def _config_folder(path: Path, **overrides: object) -> Path:
    """A bare config folder (no weights, no tokenizer), as in bench/configs/."""
    import transformers

    base = {"vocab_size": 300, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "architectures": ["LlamaForCausalLM"]}
    base.update(overrides)
    transformers.LlamaConfig(**base).save_pretrained(path)
    assert not any(path.glob("*.safetensors"))
    return path


def _linears(llm: LLM) -> list[torch.nn.Module]:
    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, (Linear, W4A16Linear))]


def test_dummy_awq_model_generates_ids_reproducibly(tmp_path) -> None:
    folder = _config_folder(tmp_path / "cfg")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for _ in range(2):
        llm = LLM(str(folder), load_format="dummy", quantization="awq", dtype="float32", num_kv_blocks=32)
        assert llm.tokenizer is None
        layers = _linears(llm)
        assert layers and all(isinstance(m, W4A16Linear) for m in layers)  # fused qkv / gate_up too
        assert all(m.integer_zeros for m in layers)  # zero point 8: the GPU takes the integer-zero decode
        out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
        assert out.outputs[0].text == "" and out.prompt == ""
        outs.append(out.outputs[0].token_ids)
    assert len(outs[0]) == 12 and outs[0] == outs[1]
    assert len(set(outs[0])) > 1  # not a degenerate constant model


def test_dummy_weight_statistics(tmp_path) -> None:
    folder = _config_folder(tmp_path / "cfg")
    dense = LLM(str(folder), load_format="dummy", dtype="float32", num_kv_blocks=32, seed=3)
    model = dense.llm_engine.model_runner.model
    emb = model.model.embed_tokens.weight
    assert abs(emb.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    awq = LLM(str(folder), load_format="dummy", quantization="awq", dtype="float32", num_kv_blocks=32)
    w4 = next(m for m in _linears(awq) if isinstance(m, W4A16Linear))
    w = dequantize_w4(w4.qweight, w4.scales, w4.zeros)
    assert abs(w.std().item() - DUMMY_STD) < 0.25 * DUMMY_STD  # scales in [0.5, 1.5] x nominal
    assert set(torch.unique((w4.qweight >> 28) & 0xF).tolist()) == set(range(16))  # top nibble random too


def test_init_is_seeded() -> None:
    a, b = Linear(16, 8, True, torch.float32), Linear(16, 8, True, torch.float32)
    init_dummy_weights(a, seed=1)
    init_dummy_weights(b, seed=1)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    init_dummy_weights(b, seed=2)
    assert not torch.equal(a.weight, b.weight)


def test_tokenizer_less_engine_refuses_text(tmp_path) -> None:
    llm = LLM(str(_config_folder(tmp_path / "cfg")), load_format="dummy", dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert llm.llm_engine.block_manager.num_free_blocks == 32  # nothing queued, nothing leaked


def test_dummy_weights_with_tokenizer_files_keep_the_tokenizer(tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m")
    llm = LLM(str(path), load_format="dummy", dtype="float32", num_kv_blocks=32)
    assert llm.tokenizer is not None
    out = llm.generate("ab", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_awq_asked_of_a_dense_checkpoint_is_refused(tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match="not an AWQ checkpoint.*lightinfer quantize"):
        LLM(str(path), quantization="awq", dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(path), load_format="random", dtype="float32")


def test_awq_group_size_choice() -> None:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=192, num_attention_heads=3)
    assert dummy_awq_config(cfg)["group_size"] == 32
    bad = transformers.LlamaConfig(hidden_size=72, intermediate_size=144, num_attention_heads=3)
    with pytest.raises(ValueError, match="no AWQ group size"):
        dummy_awq_config(bad)


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b"])
def test_bench_configs_build_as_4bit_models(name: str) -> None:
    """Every shipped config builds (on the meta device) with 4-bit layers of group size 128."""
    from lightinfer.loader import Checkpoint
    from lightinfer.models.registry import get_model_class

    ckpt = Checkpoint(str(BENCH_CONFIGS / name), read_weights=False)
    assert not ckpt.has_tokenizer
    qc = dummy_awq_config(ckpt.hf_config)
    assert qc["group_size"] == 128
    with torch.device("meta"):
        model = get_model_class(ckpt.hf_config)(ckpt.hf_config, qc, torch.float16)
    n_w4 = sum(isinstance(m, W4A16Linear) for m in model.modules())
    assert n_w4 == 7 * ckpt.hf_config.num_hidden_layers
    cfg = json.loads((BENCH_CONFIGS / name / "config.json").read_text())
    assert cfg["hidden_size"] % 128 == 0 and cfg["intermediate_size"] % 128 == 0


def test_tokenizer_less_stream_and_pipeline_are_clear_errors(tmp_path) -> None:
    from lightinfer import pipeline

    folder = _config_folder(tmp_path / "cfg")
    llm = LLM(str(folder), load_format="dummy", dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="stream\\(\\) yields text.*use generate"):
        next(iter(llm.stream([1, 2, 3])))
    with pytest.raises(ValueError, match="pipeline takes text"):
        pipeline(str(folder), load_format="dummy", dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="embedding_on_host must be"):
        LLM(str(folder), load_format="dummy", embedding_on_host="no")


def test_cli_generate_with_prompt_ids(tmp_path, capsys) -> None:
    from lightinfer.cli import main

    folder = str(_config_folder(tmp_path / "cfg"))
    common = ["generate", folder, "--dummy-weights", "--dtype", "float32", "--kv-cache-memory", "8MiB",
              "--max-tokens", "5", "--temperature", "0"]
    assert main([*common, "--prompt-ids", "5, 6 7"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 5 and all(t.isdigit() for t in ids)
    assert main([*common, "--prompt", "hi"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert main([*common, "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids takes token ids" in capsys.readouterr().err


def test_a_model_too_big_for_host_memory_is_refused_before_allocating(monkeypatch) -> None:
    """Llama-2-7B on a CPU: fp32 weights alone are 25 GiB; with a (pretend) 8 GiB machine the
    engine refuses with the figures instead of being OOM-killed."""
    from lightinfer.engine import platform

    monkeypatch.setattr(platform, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(ValueError, match=r"needs about 2[0-9]\.\d\d GiB .* only 8\.00 GiB is available"):
        LLM(str(BENCH_CONFIGS / "llama-2-7b"), load_format="dummy", device="cpu")
