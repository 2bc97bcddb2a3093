"""``cpu_experts``: the experts of the first N MoE layers live in host memory and are computed on the CPU while
the rest of the model runs on the device's backend; and the start-up advice for a 12 GB card.

Without a GPU the "device" half is the Triton path on Triton's CPU interpreter (``triton_on_cpu``): the
host-resident layers must still take the ``torch_cpu`` backend, the others the Triton kernel."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from lightinfer.engine.memory import GIB, cpu_experts_needed, moe_fit_advice
from lightinfer.layers.moe import FusedMoE
from tests.models.test_moe_parity import moe_checkpoint

BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]


def test_host_resident_layers_and_same_tokens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = moe_checkpoint(tmp_path, "qwen3-moe-mixed-layers")  # MoE layer 1 only (layer 0 dense, 3 mlp-only)
    path2 = moe_checkpoint(tmp_path, "qwen3-moe")  # MoE layers 0 and 1
    prompts = [list(range(5, 30)), list(range(40, 47))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(str(path2), dtype="float32", num_kv_blocks=32)
    with caplog.at_level(logging.INFO, logger="lightinfer"):
        split = LLM(str(path2), dtype="float32", num_kv_blocks=32, cpu_experts=1)
    assert [m.on_host for m in _experts(split)] == [True, False]
    assert split.llm_engine.model_runner.host_expert_layers == {0}
    assert all(t.device.type == "cpu" for t in _experts(split)[0].expert_weights()[0].tensors())
    assert "experts of layers 0..0 (1 layers" in caplog.text and "12 GB card" in caplog.text
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (base, split)]
    assert outs[0] == outs[1]
    mixed = LLM(str(path), dtype="float32", num_kv_blocks=32, cpu_experts=5)  # more than there are: all of them
    assert [m.layer_idx for m in _experts(mixed) if m.on_host] == [1]


def test_cpu_experts_bad_values(tmp_path: Path) -> None:
    from tests.conftest import write_tiny_checkpoint

    dense = write_tiny_checkpoint(tmp_path / "dense")
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        LLM(str(dense), dtype="float32", num_kv_blocks=8, cpu_experts=1)
    with pytest.raises(ValueError, match="cpu_experts must be an integer >= 0"):
        LLM(str(dense), cpu_experts=-1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1")
def test_host_experts_take_the_cpu_backend_while_the_rest_runs_triton(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from lightinfer.kernels import get_backend
    from lightinfer.layers.ops import triton_on_cpu

    calls: dict[str, list[int]] = {"triton": [], "torch_cpu": []}
    for name in calls:
        backend = get_backend(name)
        original = backend.fused_moe
        monkeypatch.setattr(backend, "fused_moe", lambda x, *a, _n=name, _f=original: calls[_n].append(x.shape[0])
                            or _f(x, *a))
    path = moe_checkpoint(tmp_path, "qwen3-moe")
    with triton_on_cpu():  # built under the Triton path: no CPU preparation releases the stacks it reads
        llm = LLM(str(path), load_format="dummy", quantization="awq", dtype="float32", num_kv_blocks=16,
                  skip_tokenizer_init=True, cpu_experts=1, max_num_batched_tokens=32, max_model_len=256)
        got = llm.llm_engine.prompt_logits(list(range(3, 20)))
    # one forward: layer 0's experts on the host (torch_cpu), layer 1's on the "device" (Triton)
    assert calls == {"triton": [17], "torch_cpu": [17]}
    want = llm.llm_engine.prompt_logits(list(range(3, 20)))  # all on torch_cpu
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_fit_advice_for_qwen3_30b_a3b_on_a_12_gb_card() -> None:
    from transformers import AutoConfig

    from lightinfer.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(BENCH_CONFIGS / "qwen3-30b-a3b")
    cls = get_model_class(cfg)
    parts = cls.weight_bytes_by_part(cfg, bits=4, group_size=128)
    assert 15.5 * GIB < sum(parts.values()) < 16.5 * GIB  # "about 16 GB at 4 bits"
    layers = cls.moe_layer_ids(cfg)
    per_layer = [parts["experts"] // len(layers)] * len(layers)
    on_gpu = sum(parts.values()) - parts["embed_tokens"]  # a GPU engine keeps the untied embedding on the host
    kv_per_token = 48 * 4 * 128 * 2 * 2  # fp16 K and V
    budget = int(12 * GIB * 0.9)
    n = cpu_experts_needed(on_gpu, per_layer, kv_per_token * 8192, budget)
    assert n is not None and 0 < n < len(layers)
    # n is the fewest: one layer fewer does not fit
    assert cpu_experts_needed(on_gpu - sum(per_layer[:n - 1]), [], kv_per_token * 8192, budget) is None
    text = moe_fit_advice(on_gpu, per_layer, kv_per_token, 8192, budget, "a 12 GB card")
    assert f"--cpu-experts {n} keeps the experts of the first {n} of 48 MoE layers" in text
    assert "fits on the GPU" in moe_fit_advice(on_gpu, per_layer, kv_per_token, 8192, 40 * GIB, "a 40 GB card")
    assert "does not fit even" in moe_fit_advice(on_gpu, per_layer, kv_per_token, 8192, 1 * GIB, "a 1 GB card")
