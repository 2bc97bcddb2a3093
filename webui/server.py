"""The whole server of ``lightinfer serve``: the API app with the Gradio chat UI mounted at ``/``.

The UI sits above the API in the import order, so the composition lives here, on the UI's side:
``lightinfer.entrypoints`` never imports the UI.
"""

from __future__ import annotations

import gradio as gr
from fastapi import FastAPI

from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.server import DEFAULT_MAX_REQUEST_BYTES, build_api_app
from lightinfer.webui.app import build_ui


def build_app(
    engine: AsyncLLMEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    ui_auth: tuple[str, str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ui_max_queue: int | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The API server (:func:`lightinfer.entrypoints.server.build_api_app`) plus the chat UI at ``/``.

    Args:
        engine: the shared async engine (not yet started is fine).
        served_model_name: the ``model`` name the API answers to; default ``model_info()["model"]``.
        api_key: when set, ``/v1`` needs ``Authorization: Bearer <api_key>`` (else 401).
        ui_auth: ``(user, password)`` for the Gradio UI's login page.
        max_request_bytes: larger request bodies get 413.
        ui_max_queue: Gradio's queue bound (default ``max_waiting``).
        tool_call_parser: the API's tool-call format (``--tool-call-parser``; default: from the chat template).
    Raises:
        ValueError: the engine has no tokenizer; an unknown tool_call_parser.
    """
    app = build_api_app(engine, served_model_name=served_model_name, api_key=api_key,
                        max_request_bytes=max_request_bytes, tool_call_parser=tool_call_parser)
    blocks = build_ui(engine, max_queue=ui_max_queue or engine.max_waiting)
    gr.mount_gradio_app(app, blocks, path="/", auth=ui_auth, ssr_mode=False, footer_links=["api"],
                        run_history=False, show_error=True)
    return app
