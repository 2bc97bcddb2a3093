"""The decode graph runner's padding, buffer filling and slicing, on CPU.

``DecodeGraphRunner(use_cuda_graphs=False)`` runs the model eagerly on the static buffers: the
same path a captured graph replays, minus ``torch.cuda.CUDAGraph``. The capture itself is
covered by ``tests/gpu/test_engine_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightinfer import LLM, SamplingParams
from lightinfer.engine.cuda_graph import DecodeGraphRunner, graph_batch_sizes
from lightinfer.engine.step_inputs import StepInputs
from lightinfer.layers.attention import get_context
from tests.conftest import write_tiny_checkpoint
from tests.engine.decode_recorder import EagerVsGraph


@pytest.mark.parametrize(("max_bs", "want"), [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]), (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 32]), (64, [1, 2, 4, 8, 16, 32, 48, 64]), (65, [1, 2, 4, 8, 16, 32, 48, 64, 80]),
])
def test_graph_batch_sizes(max_bs: int, want: list[int]) -> None:
    assert graph_batch_sizes(max_bs) == want


def test_graph_batch_sizes_rejects_zero() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        graph_batch_sizes(0)


class _Echo(nn.Module):
    """A stand-in model: row i of the output is (input_id, position, slot, context_len) of row i,
    read from the arguments and the attention context; it records what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        assert ctx.num_decodes == input_ids.shape[0] and ctx.cu_seqlens_q is None
        self.seen.append({"input_ids": input_ids.clone(), "slot_mapping": ctx.slot_mapping.clone(),
                          "context_lens": ctx.context_lens.clone(), "block_tables": ctx.block_tables.clone()})
        return torch.stack([input_ids.float(), positions.float(), ctx.slot_mapping.float(),
                            ctx.context_lens.float()], dim=1)


def _runner(max_bs: int = 20, width: int = 6) -> tuple[DecodeGraphRunner, _Echo]:
    model = _Echo()
    return DecodeGraphRunner(model, max_bs, width, 4, torch.float32, torch.device("cpu"), False), model


def _step(n: int) -> StepInputs:
    return StepInputs(
        input_ids=[100 + i for i in range(n)], positions=[10 * i + 3 for i in range(n)],
        slot_mapping=[7 * i + 1 for i in range(n)], context_lens=[10 * i + 4 for i in range(n)],
        block_tables=[[i + 1] * (1 + i % 3) for i in range(n)], num_decodes=n, logits_idx=list(range(n)),
    )


def test_padded_batch_size_and_can_run() -> None:
    runner, _ = _runner(max_bs=20)
    assert runner.batch_sizes == [1, 2, 4, 8, 16, 32] and runner.max_batch_size == 32
    assert [runner.padded_batch_size(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert runner.padded_batch_size(33) is None
    assert runner.can_run(_step(32)) and not runner.can_run(_step(33))
    prefill = StepInputs(input_ids=[1, 2], positions=[0, 1], slot_mapping=[0, 1], context_lens=[2],
                         block_tables=[[0]], cu_seqlens_q=[0, 2], num_decodes=0)
    assert not runner.can_run(prefill)
    wide = _step(2)
    wide.block_tables[0] = list(range(7))  # wider than the runner's 6 columns
    assert not runner.can_run(wide)
    with pytest.raises(ValueError, match="not a decode batch"):
        runner.load(wide)


def test_load_pads_rows_and_run_slices_the_real_rows() -> None:
    runner, model = _runner()
    runner.run(_step(7))  # leaves 8 rows of data behind: the next, smaller step must not see them as real
    step = _step(3)
    out = runner.run(step)
    assert out.shape == (3, 4)
    want = torch.tensor([step.input_ids, step.positions, step.slot_mapping, step.context_lens], dtype=torch.float32).T
    torch.testing.assert_close(out, want)
    seen = model.seen[-1]
    assert seen["input_ids"].tolist() == [100, 101, 102, 0]  # padded to 4
    assert seen["slot_mapping"].tolist() == [1, 8, 15, -1]  # padding: the KV store skips slot -1
    assert seen["context_lens"].tolist() == [4, 14, 24, 1]  # padding: one token of block 0
    tables = seen["block_tables"]
    assert tables.shape == (4, 6) and tables.dtype == torch.int32
    assert tables[0, :1].tolist() == [1] and tables[1, :2].tolist() == [2, 2] and tables[2, :3].tolist() == [3, 3, 3]
    assert tables[3].tolist()[:3] == [0, 0, 0]  # padding row reads block 0
    assert runner.num_runs == 2


PROMPTS = [list(range(3 + i, 20 + 9 * i)) for i in range(5)]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 19, 14, 9, 3)]


@pytest.mark.parametrize("kv,model", [("auto", "llama"), ("int8", "llama"), ("int8", "gemma2")])
def test_static_buffer_path_matches_eager_engine(tmp_path, kv: str, model: str) -> None:
    """A whole generation through the static-buffer path (decode batches shrinking from 7 to 1,
    padded to 8, 4, 2, 1; a seeded parallel-sampling request forks and copies a block) gives the
    tokens of the plain eager engine, and each decode step the same logits. Gemma 2: two KV-cache
    groups (a 24-token window), each with its own static slot mapping and block tables."""
    from tests.models.arch_cases import write_case

    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM") if model == "llama" else \
        write_case(tmp_path / "m", model)
    params = [*PARAMS, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    prompts = [*PROMPTS, list(range(40, 61))]
    opts = {"dtype": "float32", "kv_cache_dtype": kv, "num_kv_blocks": 64, "max_num_seqs": 8}
    plain = LLM(str(path), **opts)
    assert plain.llm_engine.model_runner.graph_runner is None  # CPU: no graphs
    graphed = LLM(str(path), **opts)
    model_runner = graphed.llm_engine.model_runner
    model_runner.graph_runner = model_runner.build_graph_runner(use_cuda_graphs=False)
    assert model_runner.graph_runner.num_kv_groups == (2 if model == "gemma2" else 1)
    recorder = EagerVsGraph(model_runner)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert model_runner.graph_runner.num_runs >= 20
    assert recorder.rows > 50 and recorder.argmax_agree == recorder.rows
    assert recorder.max_diff <= 1e-4, recorder.max_diff


def test_capture_failure_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """No eager fallback in the same process (torch may be left half-captured): an error that says what to do."""
    from lightinfer.engine.cuda_graph import CudaGraphCaptureError
    from lightinfer.engine.load_progress import LoadProgress
    from lightinfer.engine.platform import CudaPlatform

    llm = LLM(str(write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")), dtype="float32", num_kv_blocks=32)
    model_runner = llm.llm_engine.model_runner
    runner = model_runner.build_graph_runner(use_cuda_graphs=False)

    def fail() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture", fail)
    monkeypatch.setattr(model_runner, "build_graph_runner", lambda use_cuda_graphs: runner)
    with pytest.raises(CudaGraphCaptureError, match="stream is capturing.*enforce_eager=True.*--enforce-eager"):
        CudaPlatform().graph_runner(model_runner, LoadProgress(enabled=False))


def test_scoring_and_prefill_steps_stay_eager(tmp_path) -> None:
    llm = LLM(str(write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")), dtype="float32", num_kv_blocks=32)
    model_runner = llm.llm_engine.model_runner
    model_runner.graph_runner = model_runner.build_graph_runner(use_cuda_graphs=False)
    llm.llm_engine.prompt_logits([5])  # one token: a "decode" by shape, but all_logits
    llm.llm_engine.prompt_logits(list(range(3, 30)))
    assert model_runner.graph_runner.num_runs == 0
    llm.generate([list(range(3, 30))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert model_runner.graph_runner.num_runs == 3  # the prefill step is eager, the 3 decodes are not


def test_static_buffer_path_with_host_embedding(tmp_path) -> None:
    """With the embedding table on the host, the runner gathers rows into its static
    ``inputs_embeds`` and the forward starts after the embedding: same tokens."""
    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    opts = {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 8}
    want = [o.outputs[0].token_ids for o in LLM(str(path), **opts).generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm = LLM(str(path), **opts)
    mr = llm.llm_engine.model_runner
    embed = mr.model.embed_tokens
    mr.graph_runner = DecodeGraphRunner(mr.model, 8, mr.kv_spec.blocks_for(512), 64, torch.float32,
                                        torch.device("cpu"), False, host_embedding=embed)
    assert mr.graph_runner.inputs_embeds is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == want and mr.graph_runner.num_runs >= 20
    ids = [5, 0, 271, 5]
    assert torch.equal(embed.lookup(ids, torch.device("cpu")), embed(torch.tensor(ids)))

