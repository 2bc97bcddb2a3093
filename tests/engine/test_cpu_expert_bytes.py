"""A CPU engine's MoE experts get CPU copies (``kernels/moe_cpu.py``: prepacked fp32, int4, or the stack itself
for dense 16-bit experts), kept beside the stacked weights. The engine's reported bytes count them: in
``weight_bytes`` (as the linears' prepared forms are) and in ``cpu_dense_bytes`` (as the linears' dequantized
copies are, and as ``estimate_weight_bytes`` predicts them), ``cpu_expert_bytes`` being their part."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightinfer import LLM
from lightinfer.engine.model_runner import dequantized_linear_bytes, resident_weight_bytes
from lightinfer.layers.moe import FusedMoE
from lightinfer.models.registry import get_model_class
from tests.models.test_moe_parity import moe_checkpoint


def _copy_bytes(m: FusedMoE) -> int:
    """The bytes of the tensors ``m``'s prepared copies hold that are not ``m``'s own stacked tensors."""
    own = {t.untyped_storage().data_ptr() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    total = 0
    for p in m._prepared:
        assert p is not None  # the engine prepared both stacks at load
        tensors = [t for t in (p.weight, p.scale_zeros, *(p.packed or [])) if t is not None]
        # oneDNN's blocked tensors are opaque: their element count is the weight's, in fp32
        total += sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn
                     or t.untyped_storage().data_ptr() not in own)
    return total


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3-moe")


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("float32", "awq"), ("bfloat16", "awq"),
                                                     ("bfloat16", None)])
def test_reported_bytes_count_the_experts_cpu_copies(checkpoint: Path, dtype: str, quantization: str | None) -> None:
    extra = {"load_format": "dummy", "quantization": quantization} if quantization else {}
    llm = LLM(str(checkpoint), dtype=dtype, max_model_len=128, num_kv_blocks=16, skip_tokenizer_init=True,
              show_progress=False, **extra)
    runner, info = llm.llm_engine.model_runner, llm.llm_engine.model_info()
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    copies = sum(_copy_bytes(m) for m in moes)
    assert info["cpu_expert_bytes"] == copies
    assert info["cpu_dense_bytes"] == dequantized_linear_bytes(runner.model) + copies
    if (dtype, quantization) == ("bfloat16", None):
        assert copies == 0  # dense 16-bit experts compute with their own stacks
    else:
        assert copies > 0
    for m in moes:  # the same model without the copies: weight_bytes is that plus them
        m._prepared = (None, None)
    without, host = resident_weight_bytes(runner.model, runner.device)
    assert info["weight_bytes"] == without + copies and host == 0
    if dtype == "float32":  # what the CPU memory check predicted: 4 bytes per expert weight (prepacked fp32)
        cls = get_model_class(llm.llm_engine.checkpoint.hf_config)
        c = llm.llm_engine.checkpoint.hf_config
        assert copies == len(moes) * 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size * 4
        _, predicted = cls.estimate_weight_bytes(c, llm.llm_engine.checkpoint.quant_config, torch.float32)
        assert predicted == dequantized_linear_bytes(runner.model) + copies


def test_model_panel_says_the_experts_copies_apart() -> None:
    from lightinfer.webui.panels import model_panel

    md = model_panel({"model": "m", "quantization": {"method": "awq", "bits": 4, "group_size": 64},
                      "weight_bytes": 300 * 2**20, "checkpoint_bytes": 200 * 2**20, "cpu_dense_bytes": 100 * 2**20,
                      "cpu_expert_bytes": 100 * 2**20, "kv_cache_dtype": "bfloat16", "kv_pool_tokens": 4096,
                      "num_kv_blocks": 256, "block_size": 16, "max_model_len": 2048, "dtype": "bfloat16",
                      "device": "cpu"})
    assert "100.0 MiB are the MoE experts' copies prepared for the CPU GEMMs" in md
    assert "embedding table's rows" not in md  # none of the copies is the linears'
