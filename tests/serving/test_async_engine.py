"""AsyncLLMEngine: one loop, many clients, aborts, back-pressure, failure isolation (fake engine)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import LiveServer, fake_engine, wait_idle
from serving_fakes import SCRIPT

from lightinfer.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from lightinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


async def _run(engine: AsyncLLMEngine, prompt: str, params: SamplingParams = GREEDY) -> list[str]:
    deltas, prev = [], ""
    async for out in engine.generate(prompt, params):
        deltas.append(out.outputs[0].text[len(prev):])
        prev = out.outputs[0].text
    return deltas


def _wait_idle(engine: AsyncLLMEngine, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        time.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.get_stats()}")


@pytest.fixture
def engine() -> AsyncLLMEngine:
    eng = fake_engine(step_delay=0.005)
    eng.start()
    yield eng
    eng.shutdown()


def test_many_clients_share_one_batch(engine: AsyncLLMEngine) -> None:
    async def main() -> list[list[str]]:
        return await asyncio.gather(*[_run(engine, f"prompt {i}") for i in range(8)])

    results = asyncio.run(main())
    for deltas in results:
        assert "".join(deltas) == SCRIPT[:24]
        assert len(deltas) > 1  # streamed, not one final blob
    assert engine.get_stats().max_batch_size == 8
    _wait_idle(engine)


def test_abort_midway_frees_blocks(engine: AsyncLLMEngine) -> None:
    async def main() -> tuple[int, list[str]]:
        long = SamplingParams(temperature=0.0, max_tokens=400)
        n = 0
        async for out in engine.generate("abort me", long):
            n = len(out.outputs[0].token_ids)
            if n >= 5:
                break  # leaving the loop aborts
        other = await _run(engine, "survivor")
        return n, other

    n, other = asyncio.run(main())
    assert n >= 5 and "".join(other) == SCRIPT[:24]
    _wait_idle(engine)


def test_explicit_abort_ends_stream(engine: AsyncLLMEngine) -> None:
    async def main() -> int:
        stream = await engine.add_request("r1", "x", SamplingParams(temperature=0.0, max_tokens=400))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                engine.abort("r1")
        return count

    assert asyncio.run(main()) < 400
    _wait_idle(engine)


def test_bad_request_is_isolated(engine: AsyncLLMEngine) -> None:
    async def main() -> list[str]:
        good = asyncio.create_task(_run(engine, "good"))
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("bad", "x" * 5000, GREEDY)
        with pytest.raises(ValueError, match="token ids"):
            await engine.add_request("bad2", [10**9], GREEDY)
        return await good

    assert "".join(asyncio.run(main())) == SCRIPT[:24]


def test_duplicate_request_id_refused(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        await engine.add_request("same", "x", SamplingParams(temperature=0.0, max_tokens=200))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("same", "y", GREEDY)
        engine.abort("same")

    asyncio.run(main())
    _wait_idle(engine)


def test_failed_step_reported_and_loop_survives(engine: AsyncLLMEngine) -> None:
    async def main() -> list[str]:
        with pytest.raises(RequestFailedError, match="simulated kernel failure"):
            await _run(engine, "FAIL_STEP please")
        return await _run(engine, "after the failure")

    assert "".join(asyncio.run(main())) == SCRIPT[:24]
    assert engine.is_running


def test_back_pressure_refuses_beyond_max_waiting() -> None:
    """``--max-waiting 4 --max-num-seqs 2`` admits 2 running + 4 waiting = 6 of 12 simultaneous requests (issue 19
    item 5: requests still being handed to the engine were all counted as waiting, so it admitted 4)."""
    eng = fake_engine(step_delay=0.01, max_waiting=4, max_num_seqs=2)
    eng.start()

    async def main() -> tuple[int, int]:
        params = SamplingParams(temperature=0.0, max_tokens=30)
        results = await asyncio.gather(*[_run(eng, f"p{i}", params) for i in range(12)], return_exceptions=True)
        refused = sum(isinstance(r, EngineOverloadedError) for r in results)
        served = sum(isinstance(r, list) and "".join(r) == SCRIPT[:30] for r in results)
        return refused, served

    try:
        refused, served = asyncio.run(main())
    finally:
        eng.shutdown()
    assert (served, refused) == (6, 6)


def test_shutdown_fails_inflight_and_refuses_new() -> None:
    eng = fake_engine(step_delay=0.01)
    eng.start()

    async def main() -> None:
        stream = await eng.add_request("r", "x", SamplingParams(temperature=0.0, max_tokens=400))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("r2", "x", GREEDY)

    asyncio.run(main())
    assert not eng.is_running


def test_an_idle_engine_parks_its_thread_and_the_next_request_wakes_it() -> None:
    """``park_after_s``: the loop's thread ends when idle (its OpenMP team with it) and the next command starts
    another; requests before and after are served alike, and a parked engine counts as running."""
    import time

    from lightinfer.engine.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(fake_engine().engine, park_after_s=0.05)
    eng.start()
    try:
        first = asyncio.run(_run(eng, "a"))
        deadline = time.monotonic() + 5
        while eng.num_parks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        thread = eng._thread
        assert eng.num_parks == 1 and thread is not None and not thread.is_alive() and eng.is_running
        eng.start()  # a parked engine is started by its next command, not here
        assert eng._thread is thread
        assert asyncio.run(_run(eng, "b")) == first  # woken by the add: a new thread
        assert eng._thread is not thread and eng.num_unfinished == 0
        eng.abort("nobody")  # any command wakes it too
    finally:
        eng.shutdown()
    assert not eng.is_running


def test_real_engine_concurrent_streams_and_abort(real_server: LiveServer) -> None:
    """The real SmolLM2 behind the async engine: batched greedy streams match a lone run; abort frees."""
    engine = real_server.engine
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in ("What is the capital of France?", "Name three colors.", "What is 2 + 2?")]
    params = SamplingParams(temperature=0.0, max_tokens=12)

    async def text(prompt: str) -> str:
        return "".join(await _run(engine, prompt, params))

    async def main() -> tuple[str, list[str], int]:
        alone = await text(prompts[0])

        async def aborted() -> int:
            n = 0
            async for out in engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=200,
                                                                        ignore_eos=True)):
                n = len(out.outputs[0].token_ids)
                if n >= 3:
                    break
            return n

        *batched, n = await asyncio.gather(*[text(p) for p in prompts], aborted())
        return alone, batched, n

    alone, batched, n = asyncio.run(main())
    assert "Paris" in alone and batched[0] == alone and all(batched) and 3 <= n < 200
    stats = wait_idle(real_server.url)
    # /stats says whether CPU decode steps are replayed: this fp32 engine's are not, and why
    replay = stats["cpu_decode_replay"]
    assert replay == engine.model_info()["cpu_decode_replay"]
    assert not replay["enabled"] and "float32 activations" in replay["eager"]


def test_from_config_loads_and_steps_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CPU ops slow down ~3x once a second thread has run them (libgomp stops spinning when more
    threads than cores are managed): a server must load the model on the thread that steps it."""
    import threading

    from serving_fakes import FakeLLMEngine

    from lightinfer.config import EngineConfig
    from lightinfer.engine import llm_engine

    threads: dict[str, int] = {}

    class Recording(FakeLLMEngine):
        def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
            threads["load"] = threading.get_ident()
            super().__init__(config, step_delay=0.001)

        def step(self):  # type: ignore[no-untyped-def]
            threads["step"] = threading.get_ident()
            return super().step()

    monkeypatch.setattr(llm_engine, "LLMEngine", Recording)
    engine = AsyncLLMEngine.from_config(EngineConfig(model="fake", device="cpu", max_model_len=512))
    try:
        assert engine.is_running  # started: the app's start() is then a no-op
        engine.start()
        assert asyncio.run(_run(engine, "hello"))
        assert threads["load"] == threads["step"] != threading.get_ident()
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_from_config_raises_the_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightinfer.config import EngineConfig
    from lightinfer.engine import llm_engine

    def broken(config: EngineConfig, show_progress: bool = False) -> None:
        raise FileNotFoundError("no model at /nowhere")

    monkeypatch.setattr(llm_engine, "LLMEngine", broken)
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        AsyncLLMEngine.from_config(EngineConfig(model="fake", device="cpu", max_model_len=512))
