"""A CPU engine's MoE experts get CPU copies (``kernels/moe_cpu.py``: prepacked fp32, int4, or the stack itself
for dense 16-bit experts) that replace their W4 stacks: ``FusedMoE.pack_for_cpu`` releases those to the meta
device, so the experts are held once. The engine's reported bytes count what is really held: ``weight_bytes`` the
real tensors plus the prepared copies, ``cpu_dense_bytes`` what the CPU path's forms add (as ``estimate_weight_bytes``
predicts them), ``cpu_expert_bytes`` its experts' part: the copies less the released stacks (0 for int4)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from lightinfer.engine.model_runner import dequantized_linear_bytes, resident_weight_bytes
from lightinfer.layers.moe import FusedMoE
from lightinfer.layers.ops import use_backend
from lightinfer.layers.weight_forms import weight_form
from lightinfer.models.registry import get_model_class
from tests.models.test_moe_parity import moe_checkpoint


def _copy_bytes(m: FusedMoE) -> int:
    """The bytes of the tensors ``m``'s prepared copies hold that are not ``m``'s own stacked tensors."""
    own = {t.untyped_storage().data_ptr() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
           if not t.is_meta}
    total = 0
    for p in m._prepared:
        assert p is not None  # the engine prepared both stacks at load
        tensors = [t for t in (p.weight, p.scale_zeros, *(p.packed or [])) if t is not None]
        # oneDNN's blocked tensors are opaque: their element count is the weight's, in fp32
        total += sum(t.numel() * t.element_size() for t in tensors if t.is_mkldnn
                     or t.untyped_storage().data_ptr() not in own)
    return total


def _real_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers that hold memory (meta tensors: none), each storage once, and
    of what the linears' weight forms hold beside them (``LinearWeight.nbytes``); not the experts'."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values() if not t.is_meta}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for m in model.modules():
        form = weight_form(m)
        total += 0 if form is None else form.nbytes()
    return total


def _llm(path: Path, dtype: str, quantization: str | None) -> LLM:
    extra = {"load_format": "dummy", "quantization": quantization} if quantization else {}
    return LLM(str(path), dtype=dtype, max_model_len=128, num_kv_blocks=16, skip_tokenizer_init=True,
               show_progress=False, **extra)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3-moe")


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("float32", "awq"), ("bfloat16", "awq"),
                                                     ("bfloat16", None)])
def test_reported_bytes_count_what_the_experts_cpu_copies_add(checkpoint: Path, dtype: str,
                                                              quantization: str | None) -> None:
    llm = _llm(checkpoint, dtype, quantization)
    runner, info = llm.llm_engine.model_runner, llm.llm_engine.model_info()
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    copies = sum(_copy_bytes(m) for m in moes)
    released = sum(m.released_nbytes() for m in moes)
    assert all(m.released == (quantization is not None) for m in moes)  # W4 stacks released, dense ones kept
    assert info["cpu_expert_bytes"] == copies - released
    assert info["cpu_dense_bytes"] == dequantized_linear_bytes(runner.model) + copies - released
    assert info["weight_bytes"] == _real_bytes(runner.model) + copies  # what the process holds
    if (dtype, quantization) == ("bfloat16", None):
        assert copies == 0  # dense 16-bit experts compute with their own stacks
    elif (dtype, quantization) == ("bfloat16", "awq"):
        assert copies == released > 0 and info["cpu_expert_bytes"] == 0  # int4: the same bytes, held once
    else:
        assert info["cpu_expert_bytes"] > 0
    for m in moes:  # the same model without the copies: weight_bytes is that plus them
        m._prepared = (None, None)
    without, host = resident_weight_bytes(runner.model, runner.device)
    assert info["weight_bytes"] == without + copies and host == 0
    cls, c = get_model_class(llm.llm_engine.checkpoint.hf_config), llm.llm_engine.checkpoint.hf_config
    _, predicted = cls.estimate_weight_bytes(c, llm.llm_engine.checkpoint.quant_config, getattr(torch, dtype))
    assert predicted == info["cpu_dense_bytes"]  # what the CPU memory check predicted
    if dtype == "float32":  # 4 bytes per expert weight (prepacked fp32), less the W4 stacks
        assert copies == len(moes) * 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size * 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_w4_experts_are_held_once_and_compute_as_the_reference(checkpoint: Path, dtype: str) -> None:
    """bf16 (int4 copies) and fp32 (oneDNN's prepacked copies): the stacks are meta after load, the engine holds
    the experts once (its weight_bytes is the real tensors plus the copies, the stacks counting 0), and greedy
    tokens equal those of the reference backend's engine, which keeps and reads the stacks."""
    llm = _llm(checkpoint, dtype, "awq")
    runner = llm.llm_engine.model_runner
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.released and m.device.type == "cpu" for m in moes)
    assert all(getattr(m, n).is_meta for m in moes for n in ("w13_qweight", "w13_scales", "w2_zeros"))
    copies, stacks = sum(_copy_bytes(m) for m in moes), sum(m.released_nbytes() for m in moes)
    assert stacks > 0 and runner.weight_bytes == _real_bytes(runner.model) + copies
    with use_backend("reference"):  # not torch_cpu: no preparation, the stacks kept and read
        ref = _llm(checkpoint, dtype, "awq")
    ref_moes = [m for m in ref.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert not any(m.released for m in ref_moes)
    # the reference engine holds the stacks ours released (ours count 0: meta) and no copies
    assert sum(w.nbytes() for m in ref_moes for w in m.expert_weights()) == stacks
    assert sum(w.nbytes() for m in moes for w in m.expert_weights()) == 0
    if dtype == "bfloat16":  # int4 copies in place of the stacks, the same size: held once, as the stacks were
        assert ref.llm_engine.model_runner.weight_bytes == runner.weight_bytes
    prompts = [list(range(3, 9)), list(range(40, 61))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with use_backend("reference"):
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert ours == want and all(len(t) == 6 for t in ours)


def test_released_experts_refuse_what_would_read_the_stacks(checkpoint: Path) -> None:
    """After the release the prepared copy is the only copy of the weights: another dtype, another backend,
    dropping the copy or copying the layer (which drops it) raise instead of computing from meta tensors."""
    llm = _llm(checkpoint, "bfloat16", "awq")
    moe = next(m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE))
    x = torch.randn(3, moe.hidden_size)
    weights, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 2], [2, 3]])
    want = moe(x.to(torch.bfloat16), weights, ids)
    assert want.dtype == torch.bfloat16 and bool(torch.isfinite(want).all())
    moe.pack_for_cpu()  # a second call: a no-op, the copy kept
    torch.testing.assert_close(moe(x.to(torch.bfloat16), weights, ids), want)
    with pytest.raises(RuntimeError, match="prepared for torch.bfloat16"):
        moe(x, weights, ids)  # fp32 activations
    with use_backend("reference"), pytest.raises(RuntimeError, match="reference backend reads"):
        moe(x.to(torch.bfloat16), weights, ids)
    with pytest.raises(RuntimeError, match="released"):
        moe.weights_changed()
    with pytest.raises(RuntimeError, match="released"):
        copy.deepcopy(moe)
    torch.testing.assert_close(moe(x.to(torch.bfloat16), weights, ids), want)  # still intact


def test_model_panel_says_the_experts_copies_apart() -> None:
    from lightinfer.webui.panels import model_panel

    md = model_panel({"model": "m", "quantization": {"method": "awq", "bits": 4, "group_size": 64},
                      "weight_bytes": 300 * 2**20, "checkpoint_bytes": 200 * 2**20, "cpu_dense_bytes": 100 * 2**20,
                      "cpu_expert_bytes": 100 * 2**20, "kv_cache_dtype": "bfloat16", "kv_pool_tokens": 4096,
                      "num_kv_blocks": 256, "block_size": 16, "max_model_len": 2048, "dtype": "bfloat16",
                      "device": "cpu"})
    assert "100.0 MiB are what the MoE experts' copies prepared for the CPU GEMMs add" in md
    assert "embedding table's rows" not in md  # none of the copies is the linears'
