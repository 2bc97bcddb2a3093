"""A W4 mixture-of-experts model's GPU code path, end to end on the CPU: every op on the Triton kernels (the
fused-MoE kernel included) under Triton's interpreter, against the CPU engine's path on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.models.test_moe_parity import moe_checkpoint

pytestmark = [
    # a whole model's GPU path under the interpreter: about a minute each, so `make test-audit` / `make test-all`
    pytest.mark.audit,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                       reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1"),
]


def test_w4_moe_triton_path_matches_torch_cpu_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightinfer import LLM, SamplingParams
    from lightinfer.kernels import get_backend
    from lightinfer.layers.ops import triton_on_cpu

    triton = get_backend("triton")
    launches: list[int] = []
    original = triton.fused_moe
    monkeypatch.setattr(triton, "fused_moe", lambda x, *a: launches.append(x.shape[0]) or original(x, *a))
    # Qwen2-MoE: q/k/v biases, routed experts and the gated shared expert, all 4-bit (random AWQ weights)
    path = moe_checkpoint(tmp_path, "qwen2-moe-shared-expert")
    prompts = [list(range(3, 8)), list(range(20, 33)), list(range(50, 74))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs, logits = [], []
    for on_triton in (False, True):
        ctx = triton_on_cpu() if on_triton else torch.no_grad()
        with ctx:  # built under the Triton path: no CPU preparation releases the stacks it reads
            llm = LLM(str(path), load_format="dummy", quantization="awq", kv_cache_dtype="int8", dtype="float32",
                      skip_tokenizer_init=True, num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=16)
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            logits.append(llm.llm_engine.prompt_logits(prompts[2]))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-3, rtol=2e-3)
    assert runs[1] == runs[0] and all(len(t) == 4 for t in runs[0])
    assert launches and 1 in launches  # decode steps of one sequence went through the kernel too
