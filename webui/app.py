"""The Gradio chat UI: a ``gr.ChatInterface`` that streams from lightinfer's async engine.

Every browser tab is one more client of the same engine loop, so tabs chatting at once are
batched together. Gradio's queue would run one event at a time by default; here its
concurrency is unlimited (the engine's scheduler decides what runs) and its queue is bounded.
Stop cancels the Gradio event, which closes the generator below, which aborts the engine request
(its KV blocks are freed at the engine's next turn).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

import gradio as gr

from lightinfer.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from lightinfer.entrypoints.model_pool import ModelPool
from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.inputs import EngineRequest, InputProcessor, fit_context
from lightinfer.inputs.text import check_text
from lightinfer.sampling_params import CHAT_SAMPLING, SamplingParams
from lightinfer.webui.panels import engine_panel, model_panel
from lightinfer.webui.picker import (
    ModelTarget,
    model_choices,
    pool_engine_panel,
    pool_model_panel,
    wire_picker,
)
from lightinfer.webui.replies import (
    ReplyTracker,
    content_text,
    format_json_reply,
    history_messages,
    is_note,
    json_schema_constraint,
    note,
    refusal,
    ui_seed,
)

__all__ = ["build_ui", "content_text", "engine_panel", "format_json_reply", "history_messages", "json_schema_constraint",
           "model_panel"]


def check_message(message: Any) -> dict[str, Any]:
    """The chat box's validator: an empty message (Enter on an empty box) and text that is not Unicode (a lone
    surrogate, which only a script or a broken client sends) are refused with a message over the box, which
    keeps the text. Gradio would otherwise send an empty turn to the model, or echo the bad text into the chat
    and fail to serialize it, with a traceback in the log and the box left disabled."""
    text = content_text(message)
    if not text.strip():  # Enter on an empty box: nothing to answer (the model would reply to nothing)
        return gr.validate(False, "the message is empty: type something first")
    try:
        check_text(text, "the message")
    except ValueError as exc:
        return gr.validate(False, str(exc))
    return gr.validate(True, "")


SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "top_k": (0, 200)}  # the sliders' (min, max)


def initial_sampling(recommended: dict[str, float]) -> dict[str, float]:
    """The Sampling panel's starting values: the model's recommendation (``model_info()["sampling_defaults"]``)
    where it gives one within the sliders' ranges (:data:`SAMPLING_RANGES`), else ``sampling_params.CHAT_SAMPLING``."""
    out = dict(CHAT_SAMPLING)
    for key, (lo, hi) in SAMPLING_RANGES.items():
        value = recommended.get(key)
        if isinstance(value, (int, float)) and lo <= value <= hi:
            out[key] = int(value) if key == "top_k" else float(value)
    return out


class ChatInterface(gr.ChatInterface):
    """``gr.ChatInterface`` whose message box keeps its placeholder ("Type a message...") after the first message.

    Gradio's own clears the box on submit with ``placeholder=""`` (to hide it while the box is disabled) and
    never restores it, so from the second turn on the box was an unlabelled blank; here the clearing
    update leaves the placeholder as it is.
    """

    def _clear_and_save_textbox(self, message: Any) -> tuple[Any, Any]:
        return type(self.textbox)("", interactive=False), message


API_LINK = "OpenAI-compatible at `/v1` · [Use via API](docs) (its routes and schema, at `/docs`)"


def build_ui(engine: AsyncLLMEngine | None = None, max_queue: int = 64, title: str = "lightinfer", *,
             models: ModelPool | None = None) -> gr.Blocks:
    """The chat UI bound to ``engine``, or with a model picker over a many-model server's ``models``; mount it
    with ``gr.mount_gradio_app`` (see ``server.py``).

    Args:
        engine: the shared async engine (a one-model server).
        max_queue: Gradio's queue bound; beyond it new events are refused ("queue full").
        models: instead of ``engine``: the picker lists every model with its state, choosing one loads it, and a
            reply is made by the model chosen when it was sent (its note names it).
    Raises:
        ValueError: neither or both of engine and models.
    """
    if (engine is None) == (models is None):
        raise ValueError("build_ui takes an engine or a model pool, not both")
    # Gradio summarises its queue analytics with pandas after every event by default: every 100 is plenty.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "100")
    # Gradio asks matplotlib (when installed) for its backend around every event; the first ask imports it, and
    # unless MPLBACKEND names one also pyplot, on the event loop: 1.6 s during which no stream gets a token. A
    # server has no display: "agg", and the import happens here, at start-up.
    os.environ.setdefault("MPLBACKEND", "agg")
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib  # noqa: F401
    # Templating and tokenizing run on one worker thread with its own tokenizer (the engine thread owns the
    # engine's copy), never on the event loop that streams every tab's and API client's tokens.
    target = ModelTarget(engine, models)
    info = engine.model_info() if engine is not None else {}
    max_model_len = int(info.get("max_model_len") or 4096)  # a picker's slider: each model clamps to its context
    ui_sampling = initial_sampling(info.get("sampling_defaults") or {})
    replies = ReplyTracker()

    def prepare(inputs: InputProcessor, system: str, turns: list[dict[str, str]], max_new_tokens: int,
                settings: dict[str, Any]) -> tuple[EngineRequest, int]:
        prompt, dropped, max_new = fit_context(inputs.tokenizer, system, turns, inputs.max_model_len, max_new_tokens)
        return inputs.process(prompt, SamplingParams(max_tokens=max_new, **settings)), dropped

    async def answer(model: str | None, message: str | dict[str, Any], history: list[Any], settings: tuple[Any, ...],
                     request: gr.Request | None) -> AsyncIterator[str | list[gr.ChatMessage]]:
        try:
            # Stop (or a closed tab) closes this generator: close the reply's now, so that its abort and its numbers
            # for the "stopped" mark come at once, not when the garbage collector gets to it.
            async with target.use(model) as (engine_, inputs, prep), \
                    aclosing(reply(engine_, inputs, prep, model, message, history, *settings,
                                   request=request)) as updates:
                async for update in updates:
                    yield update
        except OpenAIError as exc:  # a model that cannot be loaded (or no longer exists)
            yield [refusal(f"⚠️ {exc.body.error.message}")]

    # Gradio passes the chat's additional inputs by position and the request by its annotated parameter: the two
    # handlers spell their parameters out (with the picker, the model comes first).
    async def respond(message: str | dict[str, Any], history: list[Any], system: str, temperature: float,
                      top_p: float, top_k: float, max_new_tokens: float, seed: float | None, json_schema: str = "",
                      request: gr.Request = None) -> AsyncIterator[str | list[gr.ChatMessage]]:
        settings = (system, temperature, top_p, top_k, max_new_tokens, seed, json_schema)
        async with aclosing(answer(None, message, history, settings, request)) as updates:
            async for update in updates:
                yield update

    async def respond_with_model(message: str | dict[str, Any], history: list[Any], model: str, system: str,
                                 temperature: float, top_p: float, top_k: float, max_new_tokens: float,
                                 seed: float | None, json_schema: str = "",
                                 request: gr.Request = None) -> AsyncIterator[str | list[gr.ChatMessage]]:
        settings = (system, temperature, top_p, top_k, max_new_tokens, seed, json_schema)
        async with aclosing(answer(model, message, history, settings, request)) as updates:
            async for update in updates:
                yield update

    async def reply(engine: AsyncLLMEngine, inputs: InputProcessor, prep: ThreadPoolExecutor, model: str | None,
                    message: str | dict[str, Any], history: list[Any], system: str, temperature: float,
                    top_p: float, top_k: float, max_new_tokens: float, seed: float | None, json_schema: str = "",
                    request: gr.Request = None) -> AsyncIterator[str | list[gr.ChatMessage]]:
        turns = history_messages(history) + [{"role": "user", "content": content_text(message)}]
        try:
            # Costs nothing, on the loop: a message far beyond the context never reaches the tokenizer.
            inputs.check_text_size(len(system or "") + len(turns[-1]["content"]), "message")
            settings = {"temperature": float(temperature), "top_p": float(top_p),
                        "top_k": int(top_k) if top_k and int(top_k) > 0 else -1, "seed": ui_seed(seed),
                        "structured_outputs": json_schema_constraint(json_schema)}
            request_, dropped = await asyncio.get_running_loop().run_in_executor(
                prep, prepare, inputs, system or "", turns, int(max_new_tokens), settings)
        except ValueError as exc:
            yield [refusal(f"⚠️ {exc}")]
            return
        notes = []
        if dropped:
            notice = f"⚠️ the conversation is longer than the context: the {dropped} oldest messages were left out"
            gr.Warning(notice)
            notes.append(note(notice))
        request_id = engine.new_request_id("ui")
        progress = replies.start(getattr(request, "session_hash", None))
        text, finished, reason = "", False, None
        try:
            async for out in engine.generate(request_, request_id=request_id):
                comp = out.outputs[0]
                progress.update(len(comp.token_ids), out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens)
                finished, reason = out.finished, comp.finish_reason
                if comp.text != text:
                    text = comp.text
                    yield notes + [gr.ChatMessage(role="assistant", content=text)] if notes else text
        except (EngineOverloadedError, RequestFailedError) as exc:
            raise gr.Error(str(exc)) from exc
        except EngineDeadError as exc:
            raise gr.Error(f"the engine is not running: {exc}") from exc
        except ValueError as exc:  # refused by the engine (e.g. a setting it cannot honour): a note, no traceback
            yield notes + [refusal(f"⚠️ {exc}")]
            return
        finally:  # Stop / tab closed: Gradio closes this generator; free the engine's blocks now
            replies.end(progress, stopped=not finished)
            engine.abort(request_id)
        if json_schema and json_schema.strip():
            text = format_json_reply(text)
        cut = " · cut at the Max new tokens limit (Sampling panel)" if reason == "length" else ""
        by = f"{model} · " if model is not None else ""  # with a picker, which model answered
        yield notes + [gr.ChatMessage(role="assistant", content=text), note(by + progress.stats() + cut)]

    async def mark_stopped(history: list[Any], request: gr.Request = None) -> Any:
        """Stop's handler: the stopped reply keeps its text and gets its numbers and a "stopped" mark."""
        stats = await replies.stopped_stats(getattr(request, "session_hash", None))
        if stats is None or not history or is_note(history[-1]):
            return gr.skip()
        return [*history, note(f"stopped · {stats}")]

    with gr.Blocks(title=title, analytics_enabled=False, fill_height=True) as demo, gr.Row():
        with gr.Column(scale=4):
            picker = None if models is None else gr.Dropdown(
                choices=model_choices(models), value=models.default_name, label="Model", elem_id="model-picker",
                info="choosing a model loads it if it is not loaded; each reply says which model made it")
            system = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=1)
            sampling = [
                gr.Slider(*SAMPLING_RANGES["temperature"], value=ui_sampling["temperature"], step=0.05,
                          label="Temperature (0 = greedy)", render=False),
                gr.Slider(*SAMPLING_RANGES["top_p"], value=ui_sampling["top_p"], step=0.05, label="top_p",
                          render=False),
                gr.Slider(*SAMPLING_RANGES["top_k"], value=ui_sampling["top_k"], step=1, label="top_k (0 = off)",
                          render=False),
                gr.Slider(1, min(4096, max_model_len - 1), value=min(256, max_model_len // 2), step=1,
                          label="Max new tokens", render=False),
                gr.Number(value=-1, precision=0, label="Seed (-1 = random)", render=False),
                gr.Code(value="", language="json", label="JSON schema (the reply must match it; empty = free text)",
                        lines=4, render=False),
            ]
            # Send and Stop as words, not bare icons: a screen reader (and `get_by_role("button", name="Stop")`)
            # then finds them by name; Gradio's icon buttons have no accessible label.
            chat = ChatInterface(
                respond if models is None else respond_with_model,
                chatbot=gr.Chatbot(label="Chat", height=480, render=False),
                submit_btn="Send", stop_btn="Stop",
                additional_inputs=[*([picker] if picker is not None else []), system, *sampling],
                additional_inputs_accordion=gr.Accordion("Sampling", open=False, render=False),
                concurrency_limit=None, autofocus=True, fill_height=False,
                title=None, analytics_enabled=False, api_name="chat", validator=check_message,
            )
            chat.textbox.stop(mark_stopped, [chat.chatbot], [chat.chatbot], queue=False,
                              api_visibility="undocumented")
        with gr.Column(scale=1, min_width=260):
            gr.Markdown("### Model")
            model_md = gr.Markdown(model_panel(info) if engine is not None else pool_model_panel(models, None))
            gr.Markdown("### Engine")
            live = gr.Markdown(engine_panel(engine) if engine is not None else pool_engine_panel(models, None))
            gr.Markdown("### API")
            gr.Markdown(API_LINK, elem_id="api-link")
            if models is None:
                gr.Timer(2.0).tick(lambda: engine_panel(engine), None, live, queue=False,
                                   api_visibility="undocumented", show_progress="hidden")
            else:
                assert picker is not None
                wire_picker(models, picker, model_md, live)
    demo.queue(max_size=max_queue, default_concurrency_limit=None)  # its poll: queue_pace.py (server.py)
    return demo
