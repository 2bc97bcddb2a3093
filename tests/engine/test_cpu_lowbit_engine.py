"""The CPU engine with low-bit weights (dtype auto on a CPU for a 4-/8-bit checkpoint: bf16 activations, the
weights kept 4-bit, in the C product's layout or torch's int4 GEMM's) against its reference twin, the exact
path and its settings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lightinfer import LLM, SamplingParams
from lightinfer.config import EngineConfig
from lightinfer.kernels import cpu_native, switches
from lightinfer.kernels.cpu_lowbit import CpuQuantWeight, CpuW4Weight, int4_gemm_available
from lightinfer.layers.linear import W4A16Linear
from lightinfer.layers.ops import use_backend
from lightinfer.layers.weight_forms import NativeW4Weight, PackedDenseWeight, TorchInt4Weight, W4RuntimeWeight

pytestmark = pytest.mark.skipif(not int4_gemm_available(), reason="this torch has no CPU int4 GEMM")

VOCAB = 512
LOWBIT = (NativeW4Weight, TorchInt4Weight)  # the 4-bit forms a CPU engine prepares
PROMPTS = [[random.Random(n).randrange(VOCAB) for _ in range(n)] for n in (5, 19, 40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    import transformers

    path = tmp_path_factory.mktemp("tiny_lowbit")
    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def _llm(path: str, **options: object) -> LLM:
    return LLM(path, load_format="dummy", quantization="awq", skip_tokenizer_init=True, show_progress=False,
               kv_cache_memory_bytes=8 << 20, max_model_len=256, max_num_batched_tokens=32, **options)


def _w4_layers(llm: LLM) -> list[W4A16Linear]:
    return [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, W4A16Linear)]


def test_auto_dtype_keeps_4bit_layers_low_bit(tiny: str) -> None:
    llm = _llm(tiny)
    assert llm.llm_engine.config.torch_dtype == torch.bfloat16
    layers = _w4_layers(llm)
    assert layers and all(isinstance(m.weight_impl, LOWBIT) and m.qweight is None for m in layers)  # one copy, 4-bit
    dense_bytes = sum(m.in_features * m.out_features * 2 for m in layers)
    assert sum(m.weight_impl.nbytes() for m in layers) < 0.35 * dense_bytes


def _check_greedy_close(runs_a: list, runs_b: list) -> int:
    """Greedy tokens of two engines equal, up to a near-tie (vLLM's ``check_logprobs_close``): where they first
    differ, each side's token must be among the other side's top logprobs; the continuations after such a
    fork are not compared. Returns how many tokens were compared identical."""
    same = 0
    for a, b in zip(runs_a, runs_b):
        for step, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[step] and tb in a.logprobs[step], (step, a.logprobs[step], b.logprobs[step])
                break
            same += 1
    return same


@pytest.mark.parametrize("product", ["c", "torch"])
def test_greedy_equals_the_reference_twin(tiny: str, product: str) -> None:
    """The bf16 engine on the CPU's 4-bit products (``c``, the default: the C product, int16 activations per
    block of 32; ``torch``: torch's int4 GEMM, bf16 activations) against the same engine with ops on the
    reference backend (each GEMM dequantizes the 4-bit run-time tensors in fp32; naive attention): the same
    greedy tokens up to near-ties, logits within bf16 rounding. This random tiny model's logits are nearly flat
    (log-probabilities about -5.5, ties in bf16: the C product's first fork is two tokens with the same bf16
    logit), so where the first fork comes is luck: measured 16 (c), 22 (torch) and 18 (int8) of 24 tokens
    before it (2026-12-06); every fork must be a near-tie (:func:`_check_greedy_close`)."""
    if product == "c" and cpu_native.find_compiler() is None:
        pytest.skip("no C compiler: the C 4-bit product is not built")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    with switches.override(cpu_w4=product):
        fast = _llm(tiny)
    kind = CpuW4Weight if product == "c" else CpuQuantWeight
    assert all(type(m.weight_impl.prepared) is kind and not getattr(m.weight_impl.prepared, "int8_activations", False)
               for m in _w4_layers(fast))
    fast_out = [o.outputs[0] for o in fast.generate(PROMPTS, params, use_tqdm=False)]
    fast_logits = fast.llm_engine.prompt_logits(PROMPTS[2])
    with use_backend("reference"):
        twin = _llm(tiny)
        assert all(type(m.weight_impl) is W4RuntimeWeight and m.qweight is not None for m in _w4_layers(twin))
        twin_out = [o.outputs[0] for o in twin.generate(PROMPTS, params, use_tqdm=False)]
        twin_logits = twin.llm_engine.prompt_logits(PROMPTS[2])
    assert _check_greedy_close(fast_out, twin_out) >= 0.5 * sum(len(o.token_ids) for o in twin_out)
    assert fast_logits.std() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(fast_logits, twin_logits, rtol=0.05, atol=0.05 * float(twin_logits.abs().max()))
    # the prompt's own greedy choices (40 positions, no feedback of earlier choices): all but near-ties agree
    agree = (fast_logits.argmax(-1) == twin_logits.argmax(-1)).float().mean()
    assert agree >= 0.9, agree


@pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler: the C 4-bit product is not built")
def test_int8_activations_keep_the_reference_twins_answers(tiny: str) -> None:
    """``LIGHTINFER_CPU_W4=int8`` (4-bit layers in C with int8 activations per block of 32; each layer is its own twin
    ``reference.w4_act_gemm(..., bits=8)`` to fp32 rounding, tests/kernels/test_cpu_w4a8.py) against the bf16 reference twin:
    the same greedy tokens up to near-ties, and the prompt's greedy choices. Its logits are further from the
    twin's than bf16 rounding (int8 activations; 16% of their norm on this random model, whose logits are
    all near-ties), so they are held to that size, not to bf16's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    with switches.override(cpu_w4="int8"):
        fast = _llm(tiny)
    assert all(isinstance(m.weight_impl, NativeW4Weight) and m.weight_impl.prepared.int8_activations
               for m in _w4_layers(fast))
    fast_out = [o.outputs[0] for o in fast.generate(PROMPTS, params, use_tqdm=False)]
    fast_logits = fast.llm_engine.prompt_logits(PROMPTS[2])
    with use_backend("reference"):
        twin = _llm(tiny)
        twin_out = [o.outputs[0] for o in twin.generate(PROMPTS, params, use_tqdm=False)]
        twin_logits = twin.llm_engine.prompt_logits(PROMPTS[2])
    assert _check_greedy_close(fast_out, twin_out) >= 0.75 * sum(len(o.token_ids) for o in twin_out)
    assert float((fast_logits - twin_logits).norm() / twin_logits.norm()) < 0.3
    assert (fast_logits.argmax(-1) == twin_logits.argmax(-1)).float().mean() >= 0.9


def test_the_exact_path_is_selectable(tiny: str) -> None:
    with switches.override(cpu_lowbit=False):
        llm = _llm(tiny)
    assert llm.llm_engine.config.torch_dtype == torch.float32
    assert all(isinstance(m.weight_impl, PackedDenseWeight) for m in _w4_layers(llm))  # dequantized once, fp32
    exact = _llm(tiny, dtype="float32")
    assert all(not isinstance(m.weight_impl, LOWBIT) for m in _w4_layers(exact))


def test_dense_checkpoints_stay_fp32_on_cpu(tmp_path: Path) -> None:
    from tests.conftest import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "dense", "LlamaForCausalLM")
    llm = LLM(str(path), num_kv_blocks=64, show_progress=False)
    assert llm.llm_engine.config.torch_dtype == torch.float32


def test_threads_setting(tiny: str) -> None:
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(model=tiny, threads=0)
    before = torch.get_num_threads()
    try:
        _llm(tiny, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_loading_shows_its_phases(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    LLM(tiny, load_format="dummy", quantization="awq", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
        max_model_len=256)
    err = capsys.readouterr().err
    for phase in ("reading", "building the model", "loading the weights", "preparing the weights for the CPU",
                  "allocating the KV cache"):
        assert phase in err, err


def test_engine_settings_win_over_the_environment_and_stay_the_engines(tiny: str) -> None:
    """``cpu_w4`` / ``cpu_lowbit`` as EngineConfig fields: the engine prepares its weights for them whatever the
    environment switch says, shows them in ``model_info()``, and leaves the process's switches as they were."""
    before = switches.current()
    with switches.override(cpu_w4="c", cpu_lowbit=True):
        torch_w4 = _llm(tiny, cpu_w4="torch")
        assert switches.current().cpu_w4 == "c"  # restored once the engine is built
    assert switches.current() == before
    assert all(type(m.weight_impl) is TorchInt4Weight for m in _w4_layers(torch_w4))
    info = torch_w4.llm_engine.model_info()
    assert (info["cpu_w4"], info["cpu_lowbit"], info["dtype"]) == ("torch", True, "bfloat16")
    with switches.override(cpu_lowbit=True):
        exact = _llm(tiny, cpu_lowbit=False)
    assert exact.llm_engine.config.torch_dtype == torch.float32  # dtype auto follows the setting, not the switch
    assert all(type(m.weight_impl) is PackedDenseWeight for m in _w4_layers(exact))
    assert exact.llm_engine.model_info()["cpu_lowbit"] is False
    with switches.override(cpu_lowbit=False):
        lowbit = _llm(tiny, cpu_lowbit=True)
    assert lowbit.llm_engine.config.torch_dtype == torch.bfloat16
    assert all(isinstance(m.weight_impl, LOWBIT) for m in _w4_layers(lowbit))


def test_unset_settings_follow_the_environment_switches(tiny: str) -> None:
    """A field left None takes the switch in force when the engine starts (the environment's, or an override's),
    and the resolved config says which."""
    with switches.override(cpu_w4="torch"):
        llm = _llm(tiny)
    assert llm.llm_engine.config.cpu_w4 == "torch" and llm.llm_engine.config.resolved
    assert all(type(m.weight_impl) is TorchInt4Weight for m in _w4_layers(llm))
