"""Whether a CPU decode step is replayed is said, for every registered architecture: each tiny 4-bit bf16 engine
either replays its decode steps (with the eager engine's tokens) or is in :data:`EXPECTED_EAGER` with the
reason it gives (``model_info()["cpu_decode_replay"]``, the start-up log line, ``/stats``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightinfer import LLM, SamplingParams
from lightinfer.kernels import cpu_native
from lightinfer.models.registry import MODEL_REGISTRY

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="the C ops do not build here")

BASE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
GEMMA = {"head_dim": 32, "sliding_window": 64}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}
# name -> (architecture, config overrides): every registered architecture, and the variants that decode otherwise
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", GEMMA),
    "gemma3": ("Gemma3ForCausalLM", GEMMA),
    "phi3": ("Phi3ForCausalLM", {}),
    "phi4mini-partial-rotary": ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {**MOE, "shared_expert_intermediate_size": 128}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", MOE),
}
# the cases that decode eagerly on a CPU, and what their reason says (README: "Models")
EXPECTED_EAGER = {
    "mistral": "attend_decode declined: a sliding window",
    "gemma2": "2 KV-cache groups",
    "gemma3": "attend_decode declined: a sliding window",
    "mixtral": "fused_moe declined: the experts' calls depend on each step's routing",
    "qwen2-moe": "fused_moe declined",
    "qwen3-moe": "fused_moe declined",
}
PROMPTS = [[5 + i for i in range(n)] for n in (4, 11)]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _config_dir(root: Path, name: str) -> str:
    import transformers

    arch, overrides = CASES[name]
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
           "Qwen2ForCausalLM": transformers.Qwen2Config, "Qwen3ForCausalLM": transformers.Qwen3Config,
           "Gemma2ForCausalLM": transformers.Gemma2Config, "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
           "Phi3ForCausalLM": transformers.Phi3Config, "MixtralForCausalLM": transformers.MixtralConfig,
           "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig, "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}[arch]
    cfg = cls(**{**BASE, **overrides})
    cfg.architectures = [arch]
    cfg.save_pretrained(root / name)
    return str(root / name)


def _llm(path: str, **options: object) -> LLM:
    return LLM(path, load_format="dummy", quantization="awq", dtype="bfloat16", skip_tokenizer_init=True,
               show_progress=False, kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_seqs=4, **options)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_every_registered_architecture_has_a_case() -> None:
    assert set(MODEL_REGISTRY) <= {arch for arch, _ in CASES.values()}


@pytest.mark.parametrize("name", list(CASES))
def test_each_architecture_replays_or_says_why_not(name: str, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = _config_dir(tmp_path, name)
    with caplog.at_level(logging.INFO, logger="lightinfer"):
        llm = _llm(path)
    said = [r.getMessage() for r in caplog.records if "CPU decode steps" in r.getMessage()]
    assert len(said) == 1  # once, at start-up
    got = _tokens(llm)
    report = llm.llm_engine.model_info()["cpu_decode_replay"]
    assert llm.llm_engine.get_stats().cpu_decode_replay == report
    if name in EXPECTED_EAGER:
        reasons = [report["eager"]] if not report["enabled"] else list(report["refused"].values())
        assert reasons and all(EXPECTED_EAGER[name] in r for r in reasons), report
        assert report["replayed"] == []
        assert "run eagerly" in said[0] and EXPECTED_EAGER[name] in said[0]
        return
    assert report["enabled"] and report["refused"] == {}, report
    assert report["replayed"] == [1, 2] and report["batch_sizes"] == [1, 4]
    assert "1-4 sequences are replayed" in said[0]
    runner = llm.llm_engine.model_runner.cpu_graph_runner
    assert runner.num_replays > 0
    assert got == _tokens(_llm(path, enforce_eager=True))  # the same C calls: the eager engine's tokens


def test_an_engine_without_replay_says_why(tmp_path: Path) -> None:
    path = _config_dir(tmp_path, "llama")
    for options, reason in (({"enforce_eager": True}, "enforce_eager is set"),
                            ({"dtype": "float32"}, "float32 activations")):
        llm = LLM(path, load_format="dummy", quantization="awq", skip_tokenizer_init=True, show_progress=False,
                  kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_seqs=4, **options)
        report = llm.llm_engine.model_info()["cpu_decode_replay"]
        assert not report["enabled"] and reason in report["eager"], report
        assert llm.llm_engine.model_runner.cpu_graph_runner is None
