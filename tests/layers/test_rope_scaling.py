"""RoPE scalings against transformers' own implementation (``modeling_rope_utils``), at positions past the
original length; the config's length limit; bad RoPE settings are clear errors at load."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lightinfer.layers.rope_scaling import inv_freq_and_scale, rope_max_positions, rope_spec
from lightinfer.layers.rotary import RotaryEmbedding

BASE = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 128}

SCALINGS = {  # name -> (config class, overrides, the config's own length limit)
    "linear": (transformers.LlamaConfig, {"max_position_embeddings": 256,
                                          "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 1024),
    "dynamic": (transformers.LlamaConfig, {"max_position_embeddings": 256,
                                           "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, 1024),
    "yarn": (transformers.Qwen2Config, {"max_position_embeddings": 1024, "rope_theta": 1e6,
                                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 256}}, 1024),
    "yarn-mscale": (transformers.LlamaConfig, {"max_position_embeddings": 1024, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}}, 1024),
    "llama3": (transformers.LlamaConfig, {"max_position_embeddings": 2048, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}, 2048),
    "longrope": (transformers.Phi3Config, {"max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                                           "rope_scaling": {"type": "longrope",
                                                            "short_factor": [1 + 0.1 * i for i in range(8)],
                                                            "long_factor": [2 + 0.5 * i for i in range(8)]}}, 1024),
    "longrope-partial": (transformers.Phi3Config, {"max_position_embeddings": 1024,
                                                   "original_max_position_embeddings": 256,
                                                   "partial_rotary_factor": 0.5,
                                                   "rope_scaling": {"type": "longrope",
                                                                    "short_factor": [1.0, 1.5, 2.0, 2.5],
                                                                    "long_factor": [3.0, 4.0, 5.0, 6.0]}}, 1024),
}


def _config(name: str) -> object:
    cls, overrides, _ = SCALINGS[name]
    return cls(**BASE, **overrides)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_tables_match_transformers_past_the_original_length(name: str) -> None:
    cfg = _config(name)
    kind = cfg.rope_parameters["rope_type"]
    limit = SCALINGS[name][2]
    assert rope_max_positions(cfg) == limit
    rope = RotaryEmbedding(rope_spec(cfg))
    rope.set_max_model_len(limit)  # the engine's longest sequence: the whole range the config allows
    # transformers for a sequence that long (the length-dependent types choose by it)
    inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), seq_len=limit)
    positions = torch.arange(limit, dtype=torch.float32)
    freqs = torch.outer(positions, inv)
    torch.testing.assert_close(rope.cos_cache, freqs.cos() * scale, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache, freqs.sin() * scale, rtol=1e-5, atol=1e-6)
    plain, _ = ROPE_INIT_FUNCTIONS["linear"](transformers.LlamaConfig(**BASE, rope_scaling={
        "rope_type": "linear", "factor": 1.0}, partial_rotary_factor=cfg.rope_parameters.get(
        "partial_rotary_factor", 1.0)), torch.device("cpu"))
    if inv.shape == plain.shape and name != "longrope-partial":
        assert not torch.allclose(inv, plain)  # the scaling is active: the test is not comparing plain RoPE


def test_length_dependent_types_follow_max_model_len() -> None:
    """LongRoPE: short factors while the engine's sequences stay within the original length, long beyond it;
    dynamic NTK: plain RoPE up to max_position_embeddings."""
    cfg = _config("longrope")
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=1024)
    torch.testing.assert_close(inv_freq_and_scale(rope_spec(cfg), 256)[0], short)
    torch.testing.assert_close(inv_freq_and_scale(rope_spec(cfg), 257)[0], long)
    torch.testing.assert_close(inv_freq_and_scale(rope_spec(cfg))[0], short)  # quantizer / standalone layers
    cfg = _config("dynamic")
    plain, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, torch.device("cpu"))
    torch.testing.assert_close(inv_freq_and_scale(rope_spec(cfg), 256)[0], plain)


def test_gemma3_layer_types_have_their_own_rope() -> None:
    cfg = transformers.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 6}, head_dim=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    local, glob = rope_spec(cfg, "sliding_attention"), rope_spec(cfg, "full_attention")
    assert (local.theta, local.rope_type) == (10000.0, "default")
    assert (glob.theta, glob.rope_type, glob.params["factor"]) == (1e6, "linear", 8.0)
    # as vLLM: Gemma 3's max_position_embeddings (128k) already counts its global layers' x8
    assert rope_max_positions(cfg) == cfg.max_position_embeddings


def test_unknown_rope_type_is_a_clear_error_at_load(tmp_path) -> None:
    from lightinfer import LLM
    from tests.conftest import write_tiny_checkpoint

    with pytest.raises(ValueError, match=r"rope scaling type 'ntk-by-parts'.*supported.*yarn"):
        rope_spec(transformers.LlamaConfig(**BASE, rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0}))
    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    cfg = (path / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "fancy", "factor": 2.0')
    (path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=r"rope scaling type 'fancy' .* is not supported; lightinfer runs"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match="longrope.*short_factor has 3 entries"):
        rope_spec(transformers.LlamaConfig(**BASE, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3,
                                                                 "long_factor": [1.0] * 8,
                                                                 "original_max_position_embeddings": 64}))


def test_max_model_len_beyond_the_config_limit_is_refused(tmp_path) -> None:
    from lightinfer import LLM
    from tests.conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", max_position_embeddings=64,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    assert llm.llm_engine.config.max_model_len == 128  # the limit includes the scaling
    with pytest.raises(ValueError, match=r"max_model_len=129 exceeds .* \(128"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, max_model_len=129)
