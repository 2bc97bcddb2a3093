"""The engine end to end on a CUDA GPU, with the Triton kernels wired in (skipped without CUDA).

Run on a GPU machine with the interpreter off: ``pytest tests/gpu/test_engine_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightinfer import LLM, SamplingParams
from tests.conftest import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="not under the interpreter"),
]

PROMPTS = [list(range(5 + i, 40 + 7 * i)) for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 64, GQA 4:1, hidden 256: small but shaped like the real thing for the kernels
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "m", "LlamaForCausalLM", hidden_size=256,
                                 intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                                 num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory, tiny):
    from lightinfer.quant.api import quantize
    from lightinfer.quant.config import QuantConfig

    out = tmp_path_factory.mktemp("gpu") / "awq"
    quantize(str(tiny), str(out), QuantConfig(method="rtn", group_size=64))
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("weights", ["fp16", "awq"])
def test_gpu_matches_cpu_path(tiny, tiny_awq, kv: str, weights: str) -> None:
    model = str(tiny if weights == "fp16" else tiny_awq)
    cpu = LLM(model, device="cpu", dtype="float32", kv_cache_dtype=kv, num_kv_blocks=128)
    gpu = LLM(model, device="cuda", dtype="float16", kv_cache_dtype=kv, num_kv_blocks=128)
    a = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert _agreement(a, b) >= 0.95


def test_preemption_on_gpu_loses_nothing(tiny) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(str(tiny), device="cuda", dtype="float16", num_kv_blocks=256)
    small = LLM(str(tiny), device="cuda", dtype="float16", num_kv_blocks=32, max_model_len=256)
    prompts = PROMPTS * 2
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == want
    engine = small.llm_engine
    assert engine.get_stats().num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_budget_too_small_is_a_clear_error(tiny) -> None:
    with pytest.raises(ValueError, match="lower max_model_len|cannot fit|KV cache"):
        LLM(str(tiny), device="cuda", dtype="float16", max_vram="1MiB")
