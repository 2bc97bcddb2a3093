"""The CPU's recorded decode steps (``engine/cpu_graph.py``): replays equal the eager engine, what cannot be
replayed runs eagerly, and the arena plan keeps live tensors apart."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from lightinfer import LLM, SamplingParams
from lightinfer.engine.cpu_graph import CaptureRefused, _place, _Ranges, inputs_within, plan_graph
from lightinfer.engine.step_inputs import StepInputs
from lightinfer.kernels import cpu_native
from lightinfer.layers.norm import RMSNorm
from tests.formats.gguf_files import write_tiny_gguf

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="the C ops do not build here")

LOWBIT = {k: T.Q4_1 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
PROMPTS = [list(range(3 + i, 20 + 9 * i)) for i in range(5)]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 19, 14, 9, 3)]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama GGUF in Q4_1 with a tied Q8_0 table: every op of its decode step has a C twin."""
    return str(write_tiny_gguf(tmp_path_factory.mktemp("q4") / "m.gguf", LOWBIT, tied=True))


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_replayed_steps_equal_the_eager_engine(tiny_q4: str, kv: str) -> None:
    """Decode batches shrinking from 5 to 1: each size is recorded once, then replayed, and the tokens are
    those of the eager engine (the same C calls: bit-identical logits, so greedy ties break alike)."""
    opts = {"dtype": "bfloat16", "kv_cache_dtype": kv, "num_kv_blocks": 64, "max_num_seqs": 8}
    eager = LLM(tiny_q4, enforce_eager=True, **opts)
    assert eager.llm_engine.model_runner.cpu_graph_runner is None
    graphed = LLM(tiny_q4, **opts)
    runner = graphed.llm_engine.model_runner.cpu_graph_runner
    assert runner is not None
    assert set(runner.cpu_graphs) == {1}  # recorded at start-up (CpuDecodeGraphRunner.probe)
    want, again = _generate(eager), _generate(eager)  # the second one reads cached prompt blocks
    assert _generate(graphed) == want
    assert runner.refused == {}
    assert set(runner.cpu_graphs) == {1, 2, 3, 4, 5}
    first = runner.num_replays
    assert first >= 15  # ~23 decode steps, 4 of them recorded
    # a second generation replays every decode step, with other blocks and positions
    assert _generate(graphed) == again
    assert runner.num_replays - first >= first + 4


@pytest.mark.skipif(not cpu_native.amx_available(), reason="no AMX on this CPU: the dense path is torch's GEMM")
def test_batches_on_the_amx_product_are_replayed(tiny_q4: str) -> None:
    """With AMX the 4-bit products of 8 or more rows (cpu_native.W4_AMX_ROWS) are a C op too: batches of 12
    down to 1 are all recorded and replayed, with the eager engine's tokens."""
    prompts = [list(range(3 + i, 12 + 3 * i)) for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(12)]
    opts = {"dtype": "bfloat16", "num_kv_blocks": 96, "max_num_seqs": 12}

    def run(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = LLM(tiny_q4, enforce_eager=True, **opts)
    want, again = run(eager), run(eager)  # the second one reads cached prompt blocks: shorter prefills
    graphed = LLM(tiny_q4, **opts)
    assert run(graphed) == want
    runner = graphed.llm_engine.model_runner.cpu_graph_runner
    assert runner is not None and runner.refused == {}
    assert {12, 8, 1} <= set(runner.cpu_graphs)
    assert run(graphed) == again


def test_a_forward_with_torch_compute_runs_eagerly(tiny_q4: str) -> None:
    """A torch op that computes in the forward (here an extra scaling of the final norm's input) refuses the
    graph for that size: the reason kept, and the steps give the eager engine's tokens."""
    opts = {"dtype": "bfloat16", "num_kv_blocks": 64, "max_num_seqs": 8}
    results = []
    for enforce_eager in (True, False):
        llm = LLM(tiny_q4, enforce_eager=enforce_eager, **opts)
        norm = llm.llm_engine.model_runner.model.model.norm
        inner = norm.forward
        norm.forward = lambda x, *a, _f=inner, **k: _f(x * 1.5, *a, **k)  # type: ignore[method-assign]
        if llm.llm_engine.model_runner.cpu_graph_runner is not None:
            llm.llm_engine.model_runner.cpu_graph_runner.reset()  # the start-up recording is of the model before
        results.append(_generate(llm))
    runner = llm.llm_engine.model_runner.cpu_graph_runner
    assert runner is not None and runner.cpu_graphs == {}
    assert set(runner.refused) == {1, 2, 3, 4, 5}
    assert "aten.mul" in runner.refused[1]
    assert results[0] == results[1]


def _with_qk_norms(llm: LLM) -> None:
    """Give every attention layer Qwen3-style per-head q/k RMSNorms (the same random weights for every engine);
    the runner's start-up recording, of the model without them, is dropped."""
    gen = torch.Generator().manual_seed(3)
    for layer in llm.llm_engine.model_runner.model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = (RMSNorm(attn.head_dim, 1e-6, torch.bfloat16) for _ in range(2))
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.rand(attn.head_dim, generator=gen) + 0.5)
    if llm.llm_engine.model_runner.cpu_graph_runner is not None:
        llm.llm_engine.model_runner.cpu_graph_runner.reset()


def test_steps_of_a_model_with_q_k_norms_are_replayed(tiny_q4: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-head q/k norms (Qwen3, Gemma 3) run as one C call per layer on the fused qkv output, so their decode
    steps are recorded and replayed, with the tokens of the eager engine and of the heads normed one by one."""
    opts = {"dtype": "bfloat16", "num_kv_blocks": 64, "max_num_seqs": 8}
    results = {}
    for name, eager in (("eager", True), ("graphed", False)):
        llm = LLM(tiny_q4, enforce_eager=eager, **opts)
        _with_qk_norms(llm)
        results[name] = _generate(llm)
    runner = llm.llm_engine.model_runner.cpu_graph_runner
    assert runner is not None and runner.refused == {} and set(runner.cpu_graphs) == {1, 2, 3, 4, 5}
    monkeypatch.setattr(cpu_native, "qk_norm_", lambda *a, **k: False)  # each head normed by the torch path
    split = LLM(tiny_q4, enforce_eager=True, **opts)
    _with_qk_norms(split)
    assert results["graphed"] == results["eager"] == _generate(split)


def _step(positions: list[int], slots: list[int], lens: list[int], tables: list[list[int]]) -> StepInputs:
    n = len(positions)
    return StepInputs(input_ids=[1] * n, positions=positions, slot_mapping=slots, context_lens=lens,
                      block_tables=tables, num_decodes=n, logits_idx=list(range(n)))


def test_an_fp32_engine_runs_eagerly(tiny_q4: str) -> None:
    """fp32 activations multiply dequantized weights with torch's GEMM (exact): nothing to replay, no runner."""
    llm = LLM(tiny_q4, dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    eager = LLM(tiny_q4, dtype="float32", num_kv_blocks=64, max_num_seqs=8, enforce_eager=True)
    assert _generate(llm) == _generate(eager)
    assert llm.llm_engine.model_runner.cpu_graph_runner is None


BOUNDS = {"positions": 100, "slots": 64, "context": 48, "blocks": 4, "block_size": 16}


@pytest.mark.parametrize(("step", "ok"), [
    (_step([20, 5], [37, 5], [21, 6], [[0, 2], [3]]), True),
    (_step([100], [5], [6], [[3]]), False),  # position past the RoPE table
    (_step([5], [64], [6], [[3]]), False),  # slot past the cache
    (_step([5], [5], [49], [[0, 1, 2, 3]]), False),  # context past the recorded work buffer
    (_step([5], [5], [0], [[0]]), False),  # empty context
    (_step([20], [5], [21], [[0, 4]]), False),  # a used block past the cache
    (_step([20], [5], [21], [[0]]), False),  # a table shorter than the context
    (_step([20], [5], [16], [[0, 4]]), True),  # entries past the context are not read
])
def test_inputs_within_recorded_limits(step: StepInputs, ok: bool) -> None:
    assert inputs_within(BOUNDS, step) is ok


def test_place_keeps_overlapping_lifetimes_apart() -> None:
    # key -> (bytes, first use, last use)
    sizes = {0: (100, 0, 2), 1: (64, 1, 3), 2: (200, 3, 5), 3: (64, 4, 4), 4: (10, 6, 7)}
    offsets, total = _place(sizes)
    for a, (na, fa, la) in sizes.items():
        assert offsets[a] % 64 == 0
        for b, (nb, fb, lb) in sizes.items():
            if a < b and fa <= lb and fb <= la:  # both alive at some call: disjoint bytes
                assert offsets[a] + na <= offsets[b] or offsets[b] + nb <= offsets[a], (a, b, offsets)
    assert total < sum(-(-n // 64) * 64 for n, _, _ in sizes.values())  # dead tensors' bytes were reused


def test_a_pointer_the_graph_cannot_keep_is_refused() -> None:
    lib = cpu_native.library()
    assert lib is not None
    x, out, stranger = torch.randn(2, 64), torch.empty(2, 32), torch.randn(64)
    with cpu_native.recording(64) as rec:
        rec.calls.append(("li_silu_mul", (x.data_ptr(), out.data_ptr(), 2, 32, 0, 1)))
        rec.calls.append(("li_silu_mul", (stranger.data_ptr(), out.data_ptr(), 1, 32, 0, 1)))
        rec.bounds.update(positions=10, slots=10, context=10, blocks=1)
    with pytest.raises(CaptureRefused, match="li_silu_mul's argument 0 points into memory"):
        plan_graph(rec, [out], out, _Ranges([x]), 16)
    graph = plan_graph(rec, [out], out, _Ranges([x, stranger]), 16)  # held: planned, the output in the arena
    assert graph.output.shape == out.shape and graph.keep
    graph.replay()
    want = torch.nn.functional.silu(stranger[:32]) * stranger[32:]
    torch.testing.assert_close(graph.output[0], want)


def test_no_recorded_attention_is_refused() -> None:
    with cpu_native.recording(64) as rec:
        pass
    with pytest.raises(CaptureRefused, match="decode attention"):
        plan_graph(rec, [], torch.empty(1), _Ranges([]), 16)


def test_the_ops_loop_replays_without_li_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built without the extension module (ctypes only), a graph loops over its calls: the same result."""
    lib = cpu_native.library()
    x, out = torch.randn(1, 64), torch.empty(1, 32)
    with cpu_native.recording(64) as rec:
        rec.calls.append(("li_silu_mul", (x.data_ptr(), out.data_ptr(), 1, 32, 0, 1)))
        rec.bounds.update(positions=10, slots=10, context=10, blocks=1)
    graphs = [plan_graph(rec, [out], out, _Ranges([x]), 16)]
    monkeypatch.setattr(lib, "replay", None)
    graphs.append(plan_graph(rec, [out], out, _Ranges([x]), 16))
    assert (graphs[0]._packed is None) == (lib.direct is False) and graphs[1]._packed is None
    want = torch.nn.functional.silu(x[0, :32]) * x[0, 32:]
    for graph in graphs:
        torch.testing.assert_close(graph.replay()[0], want)
