"""The chat UI's model picker for a many-model server (``entrypoints/model_pool.py``), and how a reply reaches
its model: :class:`ModelTarget` hands a reply the engine, input processor and preparation thread of the model
it names (a one-model server: always the same), holding the model loaded until the reply ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import gradio as gr

from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.model_pool import ModelPool
from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.inputs import InputProcessor
from lightinfer.webui.panels import engine_panel, model_panel

STATE_MARK = {"loaded": "● loaded", "loading": "◌ loading…", "unloaded": "○ not loaded", "error": "✕ failed to load"}


class ModelTarget:
    """Where a reply goes: the one engine, or the model a many-model server's picker names.

    Args:
        engine: a one-model server's engine (the UI's own input-processor copy and preparation thread are made
            here, so the engine thread's tokenizer is never shared).
        models: instead, a many-model server's pool: each model's own preparation (its ``OpenAIServing``).
    """

    def __init__(self, engine: AsyncLLMEngine | None, models: ModelPool | None) -> None:
        self.engine, self.models = engine, models
        if engine is not None:
            self.inputs = engine.input_processor.copy()
            self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightinfer-ui-inputs")

    @asynccontextmanager
    async def use(self, model: str | None) -> AsyncIterator[tuple[AsyncLLMEngine, InputProcessor, ThreadPoolExecutor]]:
        """``(engine, input processor, preparation thread)`` of ``model`` (ignored with one engine), loading it
        first; the model stays loaded until the block ends.

        Raises:
            OpenAIError: the model is unknown or cannot be loaded (the pool's 404 / 503).
        """
        if self.engine is not None:
            yield self.engine, self.inputs, self.prep
            return
        assert self.models is not None
        async with self.models.use(model or self.models.default_name) as serving:
            yield serving.engine, serving.inputs, serving.prep


def model_choices(models: ModelPool) -> list[tuple[str, str]]:
    """The picker's ``(label, name)`` choices: each model with its state."""
    return [(f"{e.name}  ({STATE_MARK.get(e.state, e.state)})", e.name) for e in models.entries.values()]


def pool_model_panel(models: ModelPool, name: str | None) -> str:
    """The Model panel for the model chosen in the picker: its details once loaded, else its state and files."""
    entry = models.entries.get(name or models.default_name)
    if entry is None:
        return "no such model"
    if entry.engine is not None:
        return model_panel({**entry.engine.model_info(), "model": entry.name})  # the name it is served under
    size = f"{entry.size_bytes / 2**20:,.1f} MiB" if entry.size_bytes else "unknown"
    lines = [f"| Model | `{entry.name}` |", "|---|---|", f"| State | {STATE_MARK.get(entry.state, entry.state)} |",
             f"| Format | {entry.format} |", f"| Files | {size} |"]
    if entry.error:
        lines.append(f"| Error | {entry.error} |")
    return "\n".join(lines)


def pool_engine_panel(models: ModelPool, name: str | None) -> str:
    """The Engine line of the chosen model, and which models are loaded."""
    entry = models.entries.get(name or models.default_name)
    loaded = ", ".join(models.loaded_names()) or "none"
    line = engine_panel(entry.engine) if entry is not None and entry.engine is not None else "not loaded"
    return f"{line}\n\nloaded: {loaded}"


def wire_picker(models: ModelPool, picker: gr.Dropdown, model_md: gr.Markdown, live: gr.Markdown) -> None:
    """Choosing a model loads it (the panels show the load's progress and result); a timer keeps the picker's
    states and the panels current."""

    async def choose(name: str) -> AsyncIterator[tuple[Any, str, str]]:
        yield gr.update(choices=model_choices(models)), pool_model_panel(models, name), pool_engine_panel(models, name)
        task = asyncio.ensure_future(models.load(name, retry=True))
        while not task.done():  # show "loading" while it loads
            await asyncio.sleep(0.5)
            yield gr.update(choices=model_choices(models)), pool_model_panel(models, name), \
                pool_engine_panel(models, name)
        try:
            task.result()
        except OpenAIError as exc:
            gr.Warning(exc.body.error.message)
        yield gr.update(choices=model_choices(models)), pool_model_panel(models, name), pool_engine_panel(models, name)

    picker.change(choose, [picker], [picker, model_md, live], concurrency_limit=None, api_visibility="undocumented",
                  show_progress="hidden")

    def refresh(name: str) -> tuple[Any, str, str]:
        return gr.update(choices=model_choices(models)), pool_model_panel(models, name), pool_engine_panel(models, name)

    gr.Timer(2.0).tick(refresh, [picker], [picker, model_md, live], queue=False, api_visibility="undocumented",
                       show_progress="hidden")
