"""The GPU memory plan's arithmetic and its error messages (pure functions, no GPU)."""

from __future__ import annotations

import pytest

from lightinfer.engine.memory import GIB, MIB, check_weights_fit, graph_reserve_bytes, plan_kv_pool


def test_graph_reserve_is_measurement_plus_margin() -> None:
    assert graph_reserve_bytes(0) == 64 * MIB
    assert graph_reserve_bytes(100 * MIB) == 110 * MIB + 64 * MIB
    assert graph_reserve_bytes(-5) == 64 * MIB  # a negative measurement (noise) counts as 0


def test_kv_pool_is_what_the_fixed_costs_leave() -> None:
    per_block = 2 * MIB
    num_blocks, report = plan_kv_pool(
        budget=8 * GIB, weight_bytes=4 * GIB, activation_bytes=GIB // 2, non_torch_bytes=GIB // 4,
        graph_bytes=GIB // 4, bytes_per_block=per_block, block_size=16, max_model_len=4096, budget_note="max_vram",
    )
    assert num_blocks == (3 * GIB) // per_block == 1536
    lines = report.splitlines()
    assert lines[0] == "GPU memory plan: budget 8.00 GiB (max_vram)"
    assert "weights          4.00 GiB" in lines[1]
    assert "activation peak  0.50 GiB" in lines[2]
    assert "CUDA graphs      0.25 GiB" in lines[3]
    assert "non-torch        0.25 GiB" in lines[4]
    assert lines[5].strip() == ("KV pool          3.00 GiB = 24576 tokens (1536 blocks of 16), "
                                "6 full sequences of max_model_len=4096")


def test_partial_blocks_round_down_and_negative_non_torch_counts_as_zero() -> None:
    num_blocks, report = plan_kv_pool(GIB, GIB // 2, 0, -MIB, 0, 3 * MIB, 16, 1024)
    assert num_blocks == (GIB // 2) // (3 * MIB)
    assert "enforce_eager: none" in report and "non-torch        0.00 GiB" in report


def test_weights_larger_than_the_budget() -> None:
    with pytest.raises(ValueError, match=r"weights \(9.00 GiB\) cannot fit .* 8.00 GiB \(max_vram 8\).*lightinfer quantize"):
        plan_kv_pool(8 * GIB, 9 * GIB, 0, 0, 0, MIB, 16, 1024, "max_vram 8")
    with pytest.raises(ValueError, match="max_vram or gpu_memory_utilization"):
        check_weights_fit(GIB, 2 * GIB)
    check_weights_fit(GIB, GIB)  # exactly full is not an error here (the KV check comes later)


def test_fixed_costs_larger_than_the_budget_name_every_number_and_remedy() -> None:
    with pytest.raises(ValueError) as err:
        plan_kv_pool(8 * GIB, 6 * GIB, GIB, GIB // 2, GIB, MIB, 16, 1024)
    msg = str(err.value)
    for want in ("cannot fit", "weights          6.00 GiB", "activation peak  1.00 GiB", "CUDA graphs      1.00 GiB",
                 "non-torch        0.50 GiB", "total fixed      8.50 GiB > budget 8.00 GiB", "max_num_batched_tokens",
                 "enforce_eager=True", "max_vram", "lightinfer quantize", "kv_cache_dtype='int8'", "lower max_model_len"):
        assert want in msg, want
    with pytest.raises(ValueError) as err:  # without graphs there is no graph advice
        plan_kv_pool(8 * GIB, 7 * GIB, 2 * GIB, 0, 0, MIB, 16, 1024)
    assert "enforce_eager=True" not in str(err.value)


def test_model_runner_cuda_budget_wiring(tmp_path, monkeypatch) -> None:
    """``ModelRunner._kv_budget_bytes`` on the CUDA platform (``CudaPlatform.kv_budget_bytes``) against a fake ``torch.cuda`` (no GPU here):
    the right measurements reach the plan, in the right places."""
    import dataclasses
    import types

    import torch

    from lightinfer import LLM
    from lightinfer.engine.platform import CudaPlatform
    from tests.conftest import write_tiny_checkpoint

    llm = LLM(str(write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")), dtype="float32", num_kv_blocks=32)
    runner = llm.llm_engine.model_runner
    runner.config = dataclasses.replace(runner.config, num_kv_blocks=None, max_vram="8GiB", max_num_seqs=20)
    runner.device = types.SimpleNamespace(type="cuda")
    runner.platform = CudaPlatform()
    mem = {"allocated": 2 * GIB, "peak": 0}
    profiled: list[int | None] = []

    def profile_run(num_tokens: int | None = None) -> None:
        profiled.append(num_tokens)
        mem["peak"] = mem["allocated"] + (GIB if num_tokens is None else 100 * MIB)

    fake = {
        "get_device_properties": lambda dev: types.SimpleNamespace(total_memory=100 * GIB, multi_processor_count=132),
        "synchronize": lambda dev=None: None, "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda dev=None: None,
        "memory_allocated": lambda dev=None: mem["allocated"], "max_memory_allocated": lambda dev=None: mem["peak"],
        "memory_reserved": lambda dev=None: 3 * GIB,
        "mem_get_info": lambda dev=None: (100 * GIB - 3 * GIB - GIB // 2, 100 * GIB),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(runner, "profile_run", profile_run)
    kv_bytes, report = runner._kv_budget_bytes()
    assert profiled == [None, 32]  # the step budget, then the largest graph batch (20 -> 32)
    per_block = runner.kv_spec.bytes_per_block
    split = runner._decode_split_bytes()  # the graphs' split-decode partials (max_model_len wide)
    assert split > 0
    fixed = 2 * GIB + GIB + graph_reserve_bytes(100 * MIB) + split + GIB // 2
    assert kv_bytes == (8 * GIB - fixed) // per_block * per_block
    assert report.startswith("GPU memory plan: budget 8.00 GiB (max_vram 8.00 GiB)")
    assert "non-torch        0.50 GiB" in report
    runner.config = dataclasses.replace(runner.config, enforce_eager=True)
    profiled.clear()
    kv_eager, report = runner._kv_budget_bytes()
    assert profiled == [None] and kv_eager > kv_bytes and "enforce_eager: none" in report
    mem["allocated"] = 9 * GIB
    profiled.clear()
    with pytest.raises(ValueError, match="cannot fit"):
        runner._kv_budget_bytes()
    assert profiled == []  # the weights check comes before any profiling


def test_profile_run_covers_the_step_budget_in_several_sequences(tmp_path) -> None:
    """max_model_len below the step budget: the probe still runs max_num_batched_tokens tokens
    (as several sequences, positions inside the rotary table) and the logits of a full step."""
    from lightinfer import LLM
    from lightinfer.layers.attention import get_context
    from tests.conftest import write_tiny_checkpoint

    llm = LLM(str(write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")), dtype="float32", num_kv_blocks=64,
              max_model_len=100, max_num_batched_tokens=256, max_num_seqs=8)
    runner = llm.llm_engine.model_runner
    seen = {}
    forward, logits = runner.model.forward, runner.model.compute_logits

    def spy_forward(ids, pos, embeds=None):
        seen["tokens"], seen["max_pos"] = ids.shape[0], int(pos.max())
        seen["cu"] = get_context().cu_seqlens_q.tolist()
        return forward(ids, pos, embeds)

    def spy_logits(hidden):
        seen["rows"] = hidden.shape[0]
        return logits(hidden)

    runner.model.forward, runner.model.compute_logits = spy_forward, spy_logits
    runner.profile_run()
    assert seen == {"tokens": 256, "max_pos": 99, "cu": [0, 100, 200, 256], "rows": 8}
