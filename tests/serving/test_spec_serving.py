"""Speculative decoding behind the HTTP server: a tiny engine with ``speculative_config`` answers through the
OpenAI API as without it, and ``/stats``, ``/metrics`` and the CLI show and take the setting."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, start_server

from lightinfer.config import EngineConfig
from lightinfer.engine.async_engine import AsyncLLMEngine
from tests.conftest import write_tiny_checkpoint
from tests.engine.spec.policies import AlwaysDraft

PROMPT = [5, 6, 7, 8] * 6


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    from lightinfer.webui.server import build_app

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "LlamaForCausalLM", seed=3)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    engine = AsyncLLMEngine.from_config(config, show_progress=False)
    engine.engine.speculator.policy = AlwaysDraft(3)  # every request meets drafts (the policy has its own tests)
    live = start_server(build_app(engine, served_model_name="tiny"), engine)
    yield live, path
    live.stop()


def test_completions_stats_and_metrics(spec_server: tuple[LiveServer, Path]) -> None:
    from lightinfer import LLM, SamplingParams

    live, path = spec_server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64, show_progress=False).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert got["choices"][0]["text"] == plain.outputs[0].text
    spec = httpx.get(f"{live.url}/stats", timeout=10).json()["spec_decode"]
    assert spec["method"] == "ngram" and spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines() if x.startswith("lightinfer_spec_decode_num_accepted_tokens_total"))
    assert float(line.split()[-1]) == spec["num_accepted_tokens"]
    assert 'lightinfer_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics


def test_the_cli_takes_the_setting_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lightinfer.cli import build_parser, main
    from lightinfer.cli.common import engine_kwargs

    args = build_parser().parse_args(["generate", "m", "--prompt", "hi", "--speculative-config", '{"method": "ngram"}'])
    assert engine_kwargs(args)["speculative_config"] == '{"method": "ngram"}'
    assert main(["generate", "smollm2-135m-instruct", "--prompt", "hi",
                 "--speculative-config", '{"method": "ngram", "num_tokens": 3}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: speculative_config: unknown key(s) 'num_tokens'") and "Traceback" not in err
