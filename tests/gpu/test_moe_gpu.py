"""Mixture of experts on a CUDA GPU: the fused-MoE kernel against its twin at real layer shapes, a W4 MoE model's
GPU path (CUDA graphs included) against the CPU path, and ``--cpu-experts`` splitting a model between the two.

Skipped without CUDA and under ``TRITON_INTERPRET=1``: run ``pytest tests/gpu/test_moe_gpu.py`` on a GPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from tests.conftest import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="real shapes: not under the interpreter"),
]

# (experts, top_k, hidden, expert width): Qwen3-30B-A3B, Mixtral-8x7B (width cut to keep the twin quick)
SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 3584)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_matches_reference_at_real_shapes(shape: tuple[int, int, int, int], tokens: int,
                                                    dtype: torch.dtype) -> None:
    from lightinfer.kernels import reference as ref
    from lightinfer.kernels.fused_moe import fused_moe
    from tests.kernels.test_triton_fused_moe import TOL, routed, w4_experts

    e, k, h, inter = shape
    gen = torch.Generator().manual_seed(tokens)
    w13 = w4_experts(e, 2 * inter, h, 128, dtype, gen, fractional=True)
    w2 = w4_experts(e, h, inter, 128, dtype, gen)
    x = (torch.randn(tokens, h, generator=gen) * 0.5).to(dtype)
    weights, ids = routed(tokens, e, k, gen)
    want = ref.fused_moe(x, w13, w2, weights, ids).float()
    for w in (w13, w2):
        w.qweight, w.scales, w.zeros = w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda()
    got = fused_moe(x.cuda(), w13, w2, weights.cuda(), ids.cuda()).float().cpu()
    scale = float(want.abs().max())
    torch.testing.assert_close(got / scale, want / scale, **TOL[dtype])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu_moe") / "m", "Qwen3MoeForCausalLM", hidden_size=256,
                                 intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=64, num_hidden_layers=4, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True)


@pytest.mark.parametrize("cpu_experts", [0, 2])
def test_gpu_moe_matches_cpu_path(tiny_moe: Path, tmp_path: Path, cpu_experts: int) -> None:
    """W4 experts (RTN), fp32 on both devices: the same greedy tokens; decode through CUDA graphs unless experts
    are on the CPU (then eager, with layers 0-1's experts in host memory)."""
    from lightinfer.quant.api import quantize
    from lightinfer.quant.config import QuantConfig

    quantize(str(tiny_moe), tmp_path / "w4", QuantConfig(method="rtn", group_size=64), progress=False)
    prompts = [list(range(5 + i, 40 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(str(tmp_path / "w4"), device="cpu", dtype="float32", num_kv_blocks=64)
    gpu = LLM(str(tmp_path / "w4"), device="cuda", dtype="float32", num_kv_blocks=64, cpu_experts=cpu_experts)
    runner = gpu.llm_engine.model_runner
    assert (runner.graph_runner is None) == bool(cpu_experts)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert got == want
