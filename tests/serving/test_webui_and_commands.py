"""Chat UI helpers (history formats, model panel) and the serve / demo commands (no model)."""

from __future__ import annotations

import argparse
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
    assert d.kv_cache_dtype == "int8" and d.host == "127.0.0.1" and d.func is commands.run_demo
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


def test_demo_serves_the_gguf_unless_awq_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    served = []
    monkeypatch.setattr(commands, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(commands, "ensure_embedded_model", lambda: None)
    monkeypatch.setattr(commands, "ensure_quantized", lambda requantize=False: Path("/cache/awq"))
    monkeypatch.setattr(commands, "run_serve", lambda args: served.append(args.model) or 0)
    assert commands.run_demo(_parse(["demo"])) == 0 and served == ["smollm2-135m-instruct"]  # 4-bit, no AWQ minutes
    commands.run_demo(_parse(["demo", "--awq"]))
    assert served[-1] == "/cache/awq"


def test_ui_queue_does_not_poll_every_millisecond() -> None:
    """Gradio's queue polls 1,000 times a second when idle (3-10% of a core for a server nobody uses)."""
    import gradio as gr

    from lightinfer.webui.app import PROGRESS_POLL_S, QUEUE_POLL_S, quiet_when_idle

    with gr.Blocks() as demo:
        gr.Markdown("x")
    demo.queue()
    assert demo._queue.sleep_when_free < QUEUE_POLL_S  # what Gradio does by default, off Windows
    quiet_when_idle(demo)
    assert demo._queue.sleep_when_free >= 0.05 and demo._queue.progress_update_sleep_when_free >= PROGRESS_POLL_S
