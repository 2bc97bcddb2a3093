"""The Gradio chat UI: a ``gr.ChatInterface`` that streams from lightinfer's async engine.

Every browser tab is one more client of the same engine loop, so tabs chatting at once are
batched together. Gradio's queue would run one event at a time by default; here its
concurrency is unlimited (the engine's scheduler decides what runs) and its queue is bounded.
Stop cancels the Gradio event, which closes the generator below, which aborts the engine request
(its KV blocks are freed at the engine's next turn).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from lightinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from lightinfer.inputs import fit_context
from lightinfer.sampling_params import SamplingParams

_STATS_TAG = "lightinfer-stats"  # metadata id of our own notes, which are never sent to the model


def content_text(content: Any) -> str:
    """A history entry's content as text: a string, or Gradio 6's list of blocks (text parts kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", "")) if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "".join(content_text(part) for part in content)
    return ""  # files, components: nothing the text model can read


def history_messages(history: list[Any]) -> list[dict[str, str]]:
    """Gradio chat history -> ``[{"role", "content"}]`` without our stats / notice notes."""
    out = []
    for msg in history:
        m = msg if isinstance(msg, dict) else getattr(msg, "__dict__", {})
        meta = m.get("metadata") or {}
        if isinstance(meta, dict) and meta.get("id") == _STATS_TAG:
            continue
        text = content_text(m.get("content"))
        if m.get("role") in ("user", "assistant") and text:
            out.append({"role": m["role"], "content": text})
    return out


def model_panel(info: dict[str, Any]) -> str:
    """Markdown table of the model: name, quantization, KV cache, memory, context."""
    q = info.get("quantization")
    quant = f"{q['method'].upper()} W{q['bits']}A16, group size {q['group_size']}" if q else "none"
    weights = info.get("weight_bytes") or 0
    return "\n".join([
        f"| Model | `{info.get('model')}` |", "|---|---|",
        f"| Quantization | {quant} |",
        f"| KV cache | {info.get('kv_cache_dtype')} |",
        f"| Weights | {weights / 2**20:,.1f} MiB |",
        (f"| KV pool | {info.get('kv_pool_tokens', 0):,} tokens ({info.get('num_kv_blocks')} blocks of "
        f"{info.get('block_size')}) |"),
        f"| Max context | {info.get('max_model_len'):,} tokens |",
        f"| Device | {info.get('device')} · {info.get('dtype')} |",
    ])


def engine_panel(engine: AsyncLLMEngine) -> str:
    """One line of live engine stats."""
    s = engine.get_stats()
    return (f"running **{s.num_running}** · waiting **{s.num_waiting}** · batch **{s.last_batch_size}** "
            f"(max {s.max_batch_size}) · KV used **{100 * s.kv_cache_usage:.0f}%** "
            f"({s.num_free_blocks}/{s.num_total_blocks} blocks free) · preemptions {s.num_preemptions}")


def _note(text: str) -> gr.ChatMessage:
    return gr.ChatMessage(role="assistant", content="", metadata={"title": text, "id": _STATS_TAG, "status": "done"})


def build_ui(engine: AsyncLLMEngine, max_queue: int = 64, title: str = "lightinfer") -> gr.Blocks:
    """The chat UI bound to ``engine``; mount it with ``gr.mount_gradio_app`` (see ``server.py``).

    Args:
        engine: the shared async engine.
        max_queue: Gradio's queue bound; beyond it new events are refused ("queue full").
    """
    # Gradio summarises its queue analytics with pandas after every event by default: every 100 is plenty.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "100")
    inputs = engine.input_processor.copy()  # its own tokenizer: the engine thread owns the engine's copy
    info = engine.model_info()
    max_model_len = int(info["max_model_len"])

    async def respond(message: str | dict[str, Any], history: list[Any], system: str, temperature: float,
                      top_p: float, top_k: float, max_new_tokens: float, seed: float | None,
                      ) -> AsyncIterator[str | list[gr.ChatMessage]]:
        turns = history_messages(history) + [{"role": "user", "content": content_text(message)}]
        try:
            prompt, dropped, max_new = fit_context(inputs.tokenizer, system or "", turns, max_model_len,
                                                   int(max_new_tokens))
            params = SamplingParams(temperature=float(temperature), top_p=float(top_p),
                                    top_k=int(top_k) if top_k and int(top_k) > 0 else -1, max_tokens=max_new,
                                    seed=int(seed) if seed is not None and seed >= 0 else None)
            request = inputs.process(prompt, params)
        except ValueError as exc:
            yield [_note(f"⚠️ {exc}")]
            return
        notes = []
        if dropped:
            notice = f"⚠️ the conversation is longer than the context: the {dropped} oldest messages were left out"
            gr.Warning(notice)
            notes.append(_note(notice))
        request_id = engine.new_request_id("ui")
        start, first, text, num_tokens = time.monotonic(), None, "", 0
        try:
            async for out in engine.generate(request, request_id=request_id):
                comp = out.outputs[0]
                num_tokens = len(comp.token_ids)
                if first is None and num_tokens:
                    first = time.monotonic()
                if comp.text != text:
                    text = comp.text
                    yield notes + [gr.ChatMessage(role="assistant", content=text)] if notes else text
        except EngineOverloadedError as exc:
            raise gr.Error(str(exc)) from exc
        except EngineDeadError as exc:
            raise gr.Error(f"the engine is not running: {exc}") from exc
        finally:  # Stop / tab closed: Gradio closes this generator; free the engine's blocks now
            engine.abort(request_id)
        elapsed = time.monotonic() - (first or start)
        rate = (num_tokens - 1) / elapsed if first is not None and num_tokens > 1 and elapsed > 0 else 0.0
        ttft = f"{first - start:.2f} s" if first is not None else "–"
        stats = f"{num_tokens} tokens · {rate:.1f} tokens/s · time to first token {ttft}"
        yield notes + [gr.ChatMessage(role="assistant", content=text), _note(stats)]

    with gr.Blocks(title=title, analytics_enabled=False, fill_height=True) as demo, gr.Row():
        with gr.Column(scale=4):
            system = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=1)
            sampling = [
                gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature (0 = greedy)", render=False),
                gr.Slider(0.05, 1.0, value=0.95, step=0.05, label="top_p", render=False),
                gr.Slider(0, 200, value=50, step=1, label="top_k (0 = off)", render=False),
                gr.Slider(1, min(4096, max_model_len - 1), value=min(256, max_model_len // 2), step=1,
                          label="Max new tokens", render=False),
                gr.Number(value=-1, precision=0, label="Seed (-1 = random)", render=False),
            ]
            gr.ChatInterface(
                respond, chatbot=gr.Chatbot(label="Chat", height=480, render=False),
                additional_inputs=[system, *sampling],
                additional_inputs_accordion=gr.Accordion("Sampling", open=False, render=False),
                concurrency_limit=None, autofocus=True, fill_height=False,
                title=None, analytics_enabled=False, api_name="chat",
            )
        with gr.Column(scale=1, min_width=260):
            gr.Markdown("### Model")
            gr.Markdown(model_panel(info))
            gr.Markdown("### Engine")
            live = gr.Markdown(engine_panel(engine))
            gr.Timer(2.0).tick(lambda: engine_panel(engine), None, live, queue=False,
                               api_visibility="undocumented", show_progress="hidden")
    demo.queue(max_size=max_queue, default_concurrency_limit=None)
    quiet_when_idle(demo)
    return demo


# Gradio's queue polls for new events every 1 ms and for progress updates every 10 ms, also when nobody
# uses the UI: 1,100 wake-ups of the server's event loop a second, 3-10% of a core for an idle server
# (bench/idle_cpu.py). Every 50 ms / 100 ms (what Gradio itself uses on Windows) costs an idle server a few
# tenths of a percent, and a chat message at most 50 ms before its event starts (the API is not affected).
QUEUE_POLL_S = 0.05
PROGRESS_POLL_S = 0.1


def quiet_when_idle(demo: gr.Blocks) -> None:
    """Make ``demo``'s Gradio queue poll at :data:`QUEUE_POLL_S` / :data:`PROGRESS_POLL_S` (see above)."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
        queue.progress_update_sleep_when_free = max(getattr(queue, "progress_update_sleep_when_free", 0.0),
                                                    PROGRESS_POLL_S)
