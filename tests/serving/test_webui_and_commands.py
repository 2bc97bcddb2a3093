"""Chat UI helpers (history formats, model panel) and the serve / demo commands (no model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from lightinfer.cli import serve as commands
from lightinfer.webui.app import content_text, history_messages, model_panel


def test_history_content_as_string_or_blocks() -> None:
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "", "metadata": {"title": "3 tokens", "id": "lightinfer-stats"}},
        {"role": "user", "content": [{"type": "file", "path": "/x.png"}, {"type": "text", "text": "and this?"}]},
        {"role": "user", "content": {"path": "/only-a-file.png"}},
    ]
    assert history_messages(history) == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and this?"}]
    assert content_text(None) == "" and content_text(("a", {"type": "text", "text": "b"})) == "ab"


def test_model_panel_lists_quantization() -> None:
    md = model_panel({"model": "m", "quantization": {"method": "awq", "bits": 4, "group_size": 64},
                      "kv_cache_dtype": "int8", "weight_bytes": 2**20, "kv_pool_tokens": 4096, "num_kv_blocks": 256,
                      "block_size": 16, "max_model_len": 2048, "device": "cpu", "dtype": "float32"})
    assert "AWQ W4A16, group size 64" in md and "int8" in md and "4,096 tokens" in md


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    commands.register(p.add_subparsers(dest="cmd"))
    return p.parse_args(argv)


def test_serve_defaults_are_safe() -> None:
    a = _parse(["serve", "some/model"])
    assert (a.host, a.port, a.kv_cache_dtype, a.func) == ("127.0.0.1", 7860, "auto", commands.run_serve)
    d = _parse(["demo"])
    # resolved by run_demo: int8 on a GPU; on a CPU the model's dtype (SmolLM2 answers its README question then)
    assert d.kv_cache_dtype is None and d.host == "127.0.0.1" and d.func is commands.run_demo
    with pytest.raises(ValueError, match="USER:PASS"):  # main() prints it as a one-line "error: ..."
        commands._parse_ui_auth("nopassword")
    e = _parse(["serve", "m", "--max-vram", "8GiB", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                "--no-prefix-caching"])
    assert (e.max_vram, e.enforce_eager, e.gpu_memory_utilization, e.no_prefix_caching) == ("8GiB", True, 0.5, True)
    assert commands._parse_ui_auth("u:p:q") == ("u", "p:q")


def test_demo_quantizes_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    class Summary:
        def format(self) -> str:
            return "summary"

    def fake_quantize(src: str, out: str, config: object, *, force: bool, progress: bool) -> Summary:
        calls.append((src, out))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text("{}")
        return Summary()

    import lightinfer.quant.api as qapi

    monkeypatch.setattr(qapi, "quantize", fake_quantize)
    first = commands.ensure_quantized()
    assert first == tmp_path / "lightinfer" / "smollm2-135m-instruct-awq" and len(calls) == 1
    assert commands.ensure_quantized() == first and len(calls) == 1  # cached: no second run
    commands.ensure_quantized(requantize=True)
    assert len(calls) == 2


def test_json_schema_box_and_formatted_reply() -> None:
    from lightinfer.webui.replies import format_json_reply, json_schema_constraint

    assert json_schema_constraint("") is None and json_schema_constraint("  \n") is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert json_schema_constraint(json.dumps(schema)) == {"json": schema}
    with pytest.raises(ValueError, match="does not hold JSON"):
        json_schema_constraint("{type: object")
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        json_schema_constraint('{"type": "objekt"}')
    assert format_json_reply('{"a": 1, "b": [1, 2]}') == '```json\n{\n  "a": 1,\n  "b": [\n    1,\n    2\n  ]\n}\n```'
    assert format_json_reply('{"a": 1') == '{"a": 1'  # cut off by the token limit: shown as it is


def test_serve_tool_call_parser_flag() -> None:
    from conftest import free_port

    a = _parse(["serve", "m", "--tool-call-parser", "llama3"])
    assert a.tool_call_parser == "llama3" and _parse(["serve", "m"]).tool_call_parser is None
    bad = _parse(["serve", "m", "--tool-call-parser", "nope", "--port", str(free_port())])
    with pytest.raises(ValueError, match="tool-call parser 'nope' is unknown"):  # before any model loads
        commands.run_serve(bad)


def test_notes_carry_no_status() -> None:
    """A note with ``status: "done"`` made Gradio draw a "•••" bubble under every earlier reply while a later
    one streamed (issue 19 item 12); notes are still recognised and kept from the model."""
    from lightinfer.webui.replies import history_messages, is_note, note

    n = note("3 tokens")
    assert "status" not in n.metadata and is_note(n) and is_note({"metadata": dict(n.metadata)})
    assert history_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                                  "metadata": dict(n.metadata)}]) == [
        {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value, seed", [(-1, None), (None, None), ("", None), (0, 0), (42.0, 42),
                                         (2**63 - 1, 2**63 - 1)])
def test_ui_seed_accepts(value: object, seed: int | None) -> None:
    from lightinfer.webui.replies import ui_seed

    assert ui_seed(value) == seed


@pytest.mark.parametrize("value, needle", [(1e30, "below 2\\*\\*63"), (float("inf"), "whole number"),
                                           (float("nan"), "whole number"), (1.5, "whole number"),
                                           ("abc", "whole number")])
def test_ui_seed_refuses(value: object, needle: str) -> None:
    """A seed of 1e30 logged a traceback (torch's generator takes 64 bits); now it is a message (issue 19 item 7)."""
    from lightinfer.webui.replies import ui_seed

    with pytest.raises(ValueError, match=needle):
        ui_seed(value)


def test_sampling_params_seed_range() -> None:
    from lightinfer.sampling_params import SamplingParams

    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**64 - 2, n=2)
    for seed in (10**30, 2**64 - 1, -(2**63) - 1):
        with pytest.raises(ValueError, match="64-bit seed"):
            SamplingParams(seed=seed, n=2)
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=True)


def test_model_panel_says_why_memory_differs_from_the_files() -> None:
    """The panel said "Weights 171.4 MiB" for a 108.7 MiB checkpoint without saying why (issue 19 item 12)."""
    md = model_panel({"model": "m", "quantization": {"method": "awq", "bits": 4, "group_size": 64},
                      "kv_cache_dtype": "int8", "weight_bytes": int(171.4 * 2**20), "checkpoint_bytes": int(108.7 * 2**20),
                      "cpu_dense_bytes": 500 * 2**20, "kv_pool_tokens": 4096, "num_kv_blocks": 256, "block_size": 16,
                      "max_model_len": 2048, "device": "cpu", "dtype": "float32"})
    assert "171.4 MiB in memory ¹" in md and "checkpoint files are 108.7 MiB" in md
    assert "float32, where files usually hold 16 bits" in md and "scales and zeros in float32" in md
    assert "of it, 500.0 MiB are the quantized layers kept dequantized for the fp32 GEMM" in md


def test_reply_tracker_reports_only_stopped_replies() -> None:
    import asyncio

    from lightinfer.webui.replies import ReplyTracker

    tracker = ReplyTracker()
    p = tracker.start("s1")
    p.update(5)
    tracker.end(p, stopped=True)
    q = tracker.start("s2")
    q.update(3)
    tracker.end(q, stopped=False)

    async def main() -> tuple[str | None, str | None, str | None]:
        return (await tracker.stopped_stats("s1"), await tracker.stopped_stats("s2", timeout=0.1),
                await tracker.stopped_stats("nobody", timeout=0.1))

    stopped, finished, unknown = asyncio.run(main())
    assert stopped is not None and stopped.startswith("5 tokens") and finished is None and unknown is None


def test_demo_serves_the_gguf_unless_awq_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    served = []
    monkeypatch.setattr(commands, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(commands, "ensure_embedded_model", lambda: None)
    monkeypatch.setattr(commands, "ensure_quantized", lambda requantize=False: Path("/cache/awq"))
    monkeypatch.setattr(commands, "run_serve", lambda args: served.append(args.model) or 0)
    args = _parse(["demo"])
    assert commands.run_demo(args) == 0 and served == [["smollm2-135m-instruct"]]  # 4-bit, no AWQ minutes
    assert args.kv_cache_dtype == ("int8" if torch.cuda.is_available() else "auto")
    commands.run_demo(_parse(["demo", "--awq"]))
    assert served[-1] == ["/cache/awq"]


def test_ui_queue_does_not_poll_every_millisecond() -> None:
    """Gradio's queue polls 1,000 times a second when idle (3-10% of a core for a server nobody uses); here once
    a second until the UI is used, then every 100 ms until it has not been for UI_ACTIVE_S."""
    import asyncio

    import gradio as gr

    from lightinfer.webui import queue_pace
    from lightinfer.webui.queue_pace import PROGRESS_POLL_S, QUEUE_IDLE_POLL_S, QUEUE_POLL_S, QueuePace

    with gr.Blocks() as demo:
        gr.Markdown("x")
    demo.queue()
    assert demo._queue.sleep_when_free < QUEUE_POLL_S  # what Gradio does by default, off Windows
    pace = QueuePace.of(demo)
    assert demo._queue.sleep_when_free == QUEUE_IDLE_POLL_S >= 1.0 and not pace.active
    assert demo._queue.progress_update_sleep_when_free >= PROGRESS_POLL_S

    async def use_then_leave() -> list[bool]:
        seen = []
        pace.touch()
        seen.append(pace.active)
        await asyncio.sleep(0.15)
        pace.touch()  # still in use: the window runs from this request
        await asyncio.sleep(0.15)
        seen.append(pace.active)  # 0.3 s after the first request, 0.15 s after the last
        await asyncio.sleep(0.2)
        seen.append(pace.active)
        return seen

    old = queue_pace.UI_ACTIVE_S
    queue_pace.UI_ACTIVE_S = 0.25
    try:
        assert asyncio.run(use_then_leave()) == [True, True, False]
    finally:
        queue_pace.UI_ACTIVE_S = old
    assert demo._queue.sleep_when_free == QUEUE_IDLE_POLL_S


def test_only_requests_to_the_ui_count_as_using_it() -> None:
    import asyncio

    from conftest import fake_engine

    from lightinfer.webui.queue_pace import UIActivity
    from lightinfer.webui.server import build_app

    touched = []

    class Pace:
        def touch(self) -> None:
            touched.append(True)

    async def app(scope, receive, send) -> None:
        pass

    middleware = UIActivity(app, Pace())
    expected = {"/v1/chat/completions": False, "/metrics": False, "/health": False, "/stats": False, "/": True,
                "/gradio_api/queue/join": True, "/config": True}
    for path, ui in expected.items():
        asyncio.run(middleware({"type": "http", "path": path}, None, None))
        assert touched == [True] * ui, path
        touched.clear()
    server_app = build_app(fake_engine())
    assert any(m.cls is UIActivity for m in server_app.user_middleware)


def test_a_server_steps_on_every_core_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the model loaded on the engine's thread (AsyncLLMEngine.from_config), both cores of a 2-core
    machine served one user at 17.9 ms per token against 21.8 with one, and 16 users 1.4x faster."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = {}
    monkeypatch.setattr(commands, "check_port_free", lambda host, port: None)

    class Stop(Exception):
        pass

    def fake_engine(cfg, show_progress=False):
        seen["threads"] = cfg.threads
        raise Stop

    from lightinfer.engine import llm_engine

    monkeypatch.setattr(llm_engine, "LLMEngine", fake_engine)
    with pytest.raises(Stop):
        commands.run_serve(_parse(["serve", "m", "--no-ui"]))
    assert seen["threads"] == "auto"  # the engine's default: every usable core unless busy (or OMP_NUM_THREADS)
    with pytest.raises(Stop):
        commands.run_serve(_parse(["serve", "m", "--no-ui", "--threads", "2"]))
    assert seen["threads"] == 2


def test_a_refused_message_and_the_replies_to_an_empty_one_are_kept_from_the_model() -> None:
    """A message the UI refused (e.g. longer than the context) stays on screen with its refusal, but later
    turns do not send it again (it pushed the real conversation out of the context before); an empty user
    turn's reply is left out with it, so roles still alternate."""
    from lightinfer.webui.replies import history_messages, is_note, refusal

    r = refusal("⚠️ the message is 15021 tokens long; the model's context holds 8192")
    assert is_note(r)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"role": "user", "content": "x" * 60_000}, {"role": "assistant", "content": "",
                                                          "metadata": dict(r.metadata)},
               {"role": "user", "content": ""}, {"role": "assistant", "content": "a reply to nothing"},
               {"role": "user", "content": "say hi"}]
    assert history_messages(history) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                         {"role": "user", "content": "say hi"}]


@pytest.mark.parametrize("message", ["", "   \n", {"text": "", "files": []}])
def test_an_empty_message_is_refused_in_the_box(message: object) -> None:
    from lightinfer.webui.app import check_message

    result = check_message(message)
    assert result["is_valid"] is False and "empty" in result["message"]
    assert check_message("hello")["is_valid"] is True


def test_the_sampling_panel_starts_from_the_models_recommendation() -> None:
    from lightinfer.sampling_params import CHAT_SAMPLING
    from lightinfer.webui.app import initial_sampling

    assert initial_sampling({}) == CHAT_SAMPLING
    assert initial_sampling({"temperature": 0.2, "top_p": 0.9}) == {"temperature": 0.2, "top_p": 0.9, "top_k": 50}
    # outside the sliders' ranges (top_k 0 means off and is kept; 500 is not a slider value): the UI's own
    assert initial_sampling({"temperature": 5.0, "top_k": 500}) == CHAT_SAMPLING
    assert initial_sampling({"top_k": 0})["top_k"] == 0


def test_sampling_defaults_come_from_generation_config_or_the_model_card(tmp_path: Path) -> None:
    from lightinfer.loader import EMBEDDED_SAMPLING, Checkpoint
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": True, "eos_token_id": 2}))
    assert Checkpoint(str(folder)).sampling_defaults() == {"temperature": 0.6, "top_p": 0.95}  # a bool is no top_k
    (folder / "generation_config.json").write_text("{not json")
    assert Checkpoint(str(folder)).sampling_defaults() == {}
    assert EMBEDDED_SAMPLING["smollm2-135m-instruct"]["temperature"] == 0.2
