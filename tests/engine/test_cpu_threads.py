"""A CPU engine's thread count (``engine/cpu_threads.py``): the automatic mode's decisions from given CPU times,
the ``/proc/stat`` reading, the fixed modes, and an engine that drops to one thread while another process holds
a core and returns when it leaves, its replayed decode steps following."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from lightinfer import LLM, SamplingParams
from lightinfer.cli.common import add_engine_args
from lightinfer.config import EngineConfig, usable_cores
from lightinfer.engine.cpu_threads import ContentionPolicy, CpuThreads, ProcStatLoad, ThreadController
from lightinfer.kernels import cpu_native
from tests.formats.gguf_files import write_tiny_gguf

POLICY = ContentionPolicy(window_s=0.25, drop_above=0.3, raise_below=0.15, hold_s=1.0)


class Machine:
    """Synthetic CPU times: ``others`` cores taken by other processes, ``own`` by this one, per second."""

    def __init__(self, cores: int = 2) -> None:
        self.cores, self.now, self.busy, self.own_total = cores, 0.0, 0.0, 0.0
        self.others, self.own = 0.0, 2.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += (self.others + self.own) * seconds
        self.own_total += self.own * seconds

    def busy_seconds(self) -> float:
        return self.busy

    def own_cpu(self) -> float:
        return self.own_total

    def clock(self) -> float:
        return self.now


def _run(ctl: ThreadController, m: Machine, seconds: float, step: float = 0.05) -> list[int]:
    """Steps of ``step`` seconds for ``seconds``; the count each step ran on."""
    counts = []
    for _ in range(round(seconds / step)):
        counts.append(ctl.observe(m.now, m.busy, m.own_total))
        m.own = min(ctl.threads, m.cores)  # spinning OpenMP threads keep their cores busy
        m.advance(step)
    return counts


def test_an_idle_machine_keeps_every_core() -> None:
    m, ctl = Machine(), ThreadController(2, 2, POLICY)
    m.others = 0.1  # a process waking now and then
    assert set(_run(ctl, m, 5.0)) == {2}
    assert ctl.switches == 0 and ctl.others_cores == pytest.approx(0.1)


def test_one_busy_process_takes_a_thread_until_it_leaves() -> None:
    m, ctl = Machine(), ThreadController(2, 2, POLICY)
    m.others = 2 / 3  # a busy loop beside 2 spinning threads gets 2/3 of a core
    counts = _run(ctl, m, 1.0)
    assert counts[0] == 2 and counts[-1] == 1
    assert counts.index(1) in (5, 6)  # the first decision, a window (0.25 s) after the first sample
    m.others = 1.0  # on one thread the busy loop has its whole core: the engine stays on one
    assert set(_run(ctl, m, 3.0)) == {1}
    m.others = 0.02  # it left: back to two, the core being seen free without trying it
    counts = _run(ctl, m, 1.0)
    assert counts[-1] == 2 and ctl.switches == 2
    assert counts.index(2) <= 11  # within two windows (the first still holds some of the busy time)


def test_hysteresis_and_hold() -> None:
    m, ctl = Machine(), ThreadController(2, 2, POLICY)
    m.others = 0.2  # between raise_below and drop_above: whatever the count is, it stays
    assert set(_run(ctl, m, 2.0)) == {2}
    m.others = 0.5
    _run(ctl, m, 0.5)
    assert ctl.threads == 1
    m.others = 0.2
    assert set(_run(ctl, m, 2.0)) == {1}
    hold = ThreadController(2, 2, ContentionPolicy(hold_s=10.0))
    m2 = Machine()
    m2.others = 1.0
    _run(hold, m2, 0.5)
    assert hold.threads == 1
    m2.others = 0.0  # free again, but not taken back sooner than hold_s after the last change
    counts = _run(hold, m2, 20.0)
    assert counts.index(2) * 0.05 + 0.5 >= 10.0


def test_many_cores_give_up_what_others_take() -> None:
    m, ctl = Machine(16), ThreadController(16, 16, POLICY)
    m.others = 3.0
    _run(ctl, m, 1.0)
    assert ctl.threads == 13
    m.others = 20.0  # never below one thread
    _run(ctl, m, 1.0)
    assert ctl.threads == 1


def test_short_spans_decide_nothing() -> None:
    ctl = ThreadController(2, 2, POLICY)
    assert ctl.observe(0.0, 0.0, 0.0) == 2
    assert ctl.observe(0.1, 0.2, 0.0) == 2 and ctl.others_cores is None  # 0.1 s < window_s
    assert ctl.observe(0.3, 0.6, 0.0) == 1 and ctl.others_cores == pytest.approx(2.0)


def test_a_window_across_an_idle_gap_decides_nothing() -> None:
    """The engine sat idle for 5 s while another process ran; that process has ended when steps resume: the
    stale window is dropped unread and the steps keep every core, while a competitor that is still there is
    seen one window later."""
    m, ctl = Machine(), ThreadController(2, 2, POLICY)
    _run(ctl, m, 1.0)
    m.own, m.others = 0.0, 2.0  # no steps; something else takes both cores
    m.advance(5.0)
    m.others = 0.0
    assert set(_run(ctl, m, 2.0)) == {2} and ctl.switches == 0
    m.own, m.others = 0.0, 2.0
    m.advance(5.0)  # this time it goes on running beside the steps
    m.others = 2 / 3
    counts = _run(ctl, m, 1.0)
    assert counts[0] == 2 and counts[-1] == 1 and counts.index(1) in (5, 6)


def test_policy_and_controller_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="raise_below"):
        ContentionPolicy(drop_above=0.1, raise_below=0.2)
    with pytest.raises(ValueError, match="stale_s"):
        ContentionPolicy(window_s=0.5, stale_s=0.25)
    with pytest.raises(ValueError, match="max_threads"):
        ThreadController(0, 2)


STAT = """cpu  100 5 50 1000 7 1 2 3 0 0
cpu0 60 5 30 400 3 1 1 2 0 0
cpu1 40 0 20 600 4 0 1 1 0 0
intr 12345 0 0 1
ctxt 999
"""


def test_proc_stat_sums_the_busy_columns_of_our_cores(tmp_path: Path) -> None:
    path = tmp_path / "stat"
    path.write_text(STAT)
    tick = 1.0 / __import__("os").sysconf("SC_CLK_TCK")
    one = ProcStatLoad({1}, path)
    assert one.cores == 1
    assert one.busy_seconds() == pytest.approx((40 + 0 + 20 + 0 + 1 + 1) * tick)  # not idle (600) nor iowait (4)
    both = ProcStatLoad({0, 1}, path)
    assert both.cores == 2 and both.busy_seconds() == pytest.approx((99 + 62) * tick)
    renumbered = ProcStatLoad({5, 6}, path)  # cores the file does not list: the machine-wide line
    assert renumbered.cores == 2 and renumbered.busy_seconds() == pytest.approx((100 + 5 + 50 + 1 + 2 + 3) * tick)
    path.write_text("intr 1 2 3\n")
    with pytest.raises(ValueError, match="no cpu lines"):
        ProcStatLoad({0}, path)


def test_fixed_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert CpuThreads(3).mode == "fixed" and CpuThreads(3).info()["max_threads"] == 3
    assert CpuThreads("auto", load=Machine()).mode == "auto"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = CpuThreads("auto", load=Machine())
    assert threads.mode == "fixed" and threads.reason == "OMP_NUM_THREADS set"
    threads.before_step()  # nothing to decide


def test_no_proc_stat_keeps_the_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    from lightinfer.engine import cpu_threads

    def missing(cpus: set[int]) -> ProcStatLoad:
        return ProcStatLoad(cpus, tmp_path / "no-such-file")

    monkeypatch.setattr(cpu_threads, "ProcStatLoad", missing)
    threads = CpuThreads("auto")
    assert threads.mode == "fixed" and "per-core CPU times" in threads.reason
    assert threads.max_threads == usable_cores()


def test_the_thread_count_is_applied_once_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightinfer.engine import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)  # whatever this machine has
    m = Machine()
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = CpuThreads("auto", POLICY, load=m, own_cpu=m.own_cpu, clock=m.clock)
    m.others = 1.0
    reads = []
    real = m.busy_seconds
    m.busy_seconds = lambda: reads.append(m.now) or real()  # type: ignore[method-assign]
    for _ in range(20):  # 20 steps of 30 ms: a sample at 0, 0.27, 0.54 (every window, not every step)
        threads.before_step()
        m.advance(0.03)
    assert reads == pytest.approx([0.0, 0.27, 0.54])
    assert calls == [1]
    info = threads.info()
    assert info["mode"] == "auto" and info["threads"] == 1 and info["switches"] == 1
    assert info["others_cores"] == pytest.approx(1.0, abs=0.01)


def test_config_and_flag() -> None:
    assert EngineConfig(model="m", device="cpu").threads == "auto"
    assert EngineConfig(model="m", device="cpu", threads=None).threads == "auto"
    assert EngineConfig(model="m", device="cpu", threads=2).threads == 2
    for bad in (0, "4", True, 1.5):
        with pytest.raises(ValueError, match="threads must be"):
            EngineConfig(model="m", device="cpu", threads=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).threads == "auto"
    assert parser.parse_args(["--threads", "auto"]).threads == "auto"
    assert parser.parse_args(["--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


# ---------------------------------------------------------------- an engine

LOWBIT = {k: T.Q4_1 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
PROMPTS = [list(range(3 + i, 20 + 9 * i)) for i in range(3)]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 19, 14)]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("q4") / "m.gguf", LOWBIT, tied=True))


@pytest.fixture
def restore_threads() -> object:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.skipif(cpu_native.library() is None, reason="the C ops do not build here")
@pytest.mark.skipif(usable_cores() < 2, reason="one usable core: nothing to adapt")
def test_an_engine_follows_the_contention(tiny_q4: str, monkeypatch: pytest.MonkeyPatch,
                                          restore_threads: object) -> None:
    """Another process holds a core from the second step: the engine steps on one thread (its decode steps
    recorded and replayed on one), then it leaves and the engine returns to every core (the sizes recorded on
    one thread recorded again on more); the tokens are the eager engine's throughout."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    opts = {"dtype": "bfloat16", "num_kv_blocks": 64, "max_num_seqs": 4}
    want = _generate(LLM(tiny_q4, enforce_eager=True, threads=1, **opts))
    llm = LLM(tiny_q4, **opts)
    engine, runner = llm.llm_engine, llm.llm_engine.model_runner
    info = engine.model_info()["cpu_threads"]
    cores = usable_cores()
    assert info["mode"] == "auto" and info["max_threads"] == cores and info["threads"] == cores
    assert torch.get_num_threads() == cores
    m = Machine(cores)
    m.others = float(cores)  # as busy as it can be: one thread left
    seen: list[int] = []

    def clock() -> float:  # a second per step: every step decides
        seen.append(torch.get_num_threads())
        m.advance(1.0)
        return m.now

    runner.cpu_threads = CpuThreads("auto", load=m, own_cpu=m.own_cpu, clock=clock)
    assert _generate(llm) == want
    graphs = runner.cpu_graph_runner
    assert seen[0] == cores and 1 in seen and engine.model_info()["cpu_threads"]["threads"] == 1
    # the batch of one was recorded at start-up on every core (the runner's probe) and replays on fewer; the
    # sizes first seen while contended were recorded on one thread
    assert graphs.num_replays > 0 and graphs.cpu_graphs[1].threads == cores
    assert len(graphs.cpu_graphs) > 1 and all(g.threads == 1 for bs, g in graphs.cpu_graphs.items() if bs != 1)
    m.others = 0.0
    assert _generate(llm) == want
    assert torch.get_num_threads() == cores
    state = engine.model_info()["cpu_threads"]
    assert state["threads"] == cores and state["switches"] == 2 and state["others_cores"] == 0.0
    assert all(g.threads == cores for g in graphs.cpu_graphs.values())


@pytest.mark.skipif(cpu_native.library() is None, reason="the C ops do not build here")
def test_a_graph_replays_on_fewer_threads_only() -> None:
    from lightinfer.engine.cpu_graph import _Ranges, plan_graph

    x, out = torch.randn(1, 64), torch.empty(1, 32)
    with cpu_native.recording(64) as rec:
        rec.calls.append(("li_silu_mul", (x.data_ptr(), out.data_ptr(), 1, 32, 0, 2)))
        rec.bounds.update(positions=10, slots=10, context=10, blocks=1)
    graph = plan_graph(rec, [out], out, _Ranges([x]), 16)
    assert graph.threads == 2
    assert graph.calls_for(1)[0][1][-1] == 1 and graph.calls_for(2)[0][1][-1] == 2
    want = torch.nn.functional.silu(x[0, :32]) * x[0, 32:]
    torch.testing.assert_close(graph.replay(1)[0], want)
    torch.testing.assert_close(graph.replay()[0], want)
    with pytest.raises(ValueError, match="replays on 1 to 2"):
        graph.calls_for(3)


def test_the_async_engine_reports_the_count_of_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLMEngine.model_info() is read at start, except the thread state, which changes as it serves."""
    from types import SimpleNamespace

    from lightinfer.engine.async_engine import AsyncLLMEngine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    m = Machine()
    threads = CpuThreads("auto", load=m, own_cpu=m.own_cpu, clock=m.clock)
    front = AsyncLLMEngine.__new__(AsyncLLMEngine)
    front.engine = SimpleNamespace(model_runner=SimpleNamespace(cpu_threads=threads))
    front._model_info = {"model": "m", "cpu_threads": threads.info()}
    assert front.model_info()["cpu_threads"]["others_cores"] is None
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    threads.before_step()
    m.others = 1.0
    m.advance(1.0)
    threads.before_step()
    assert front.model_info()["cpu_threads"]["others_cores"] == pytest.approx(1.0)
    assert front.model_info()["model"] == "m"
