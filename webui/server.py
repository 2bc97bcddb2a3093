"""The whole server of ``lightinfer serve``: the API app with the Gradio chat UI mounted at ``/``.

The UI sits above the API in the import order, so the composition lives here, on the UI's side:
``lightinfer.entrypoints`` never imports the UI.

Who may use what (the README's "Security" section says the same):

* ``api_key`` guards everything but ``/health`` and the API's description (``/openapi.json``, ``/docs``,
  ``/redoc``: routes and fields, nothing of the server's state). The API routes (``/v1``, ``/metrics``, ``/stats``) take
  it as ``Authorization: Bearer``; the chat UI, whose page and routes (``/gradio_api/...``, the ones
  that generate included) a browser cannot send a header to, asks for it on its login page instead
  (any user name, the key as password) unless ``ui_auth`` gives it a user and password of its own.
  So the UI is never more open than the API.
* Without ``api_key`` and ``ui_auth`` everything is open to whoever reaches the port (127.0.0.1, this
  machine, by default).
* Uploads are off: the chat UI takes text only, so Gradio's upload route answers 403 and no client can
  write files on the server.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

import gradio as gr
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.model_pool import ModelPool
from lightinfer.entrypoints.server import DEFAULT_MAX_REQUEST_BYTES, build_api_app
from lightinfer.webui.app import build_ui
from lightinfer.webui.queue_pace import QueuePace, UIActivity

API_KEY_LOGIN_MESSAGE = "This server is protected by an API key: log in with any user name and the API key as password."
_UPLOAD_ROUTE = re.compile(r"(/gradio_api)?/upload(_progress)?/?")


class RefuseUploads:
    """ASGI middleware answering 403 to Gradio's upload routes (nothing in the chat UI uploads files)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _UPLOAD_ROUTE.fullmatch(scope.get("path", "")):
            body = {"error": {"message": "uploads are off: the chat UI takes text only", "type": "invalid_request_error",
                              "param": None, "code": "uploads_disabled"}}
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def ui_login(api_key: str | None, ui_auth: tuple[str, str] | None) -> tuple[Callable | tuple[str, str] | None, str | None]:
    """Gradio's ``auth`` and ``auth_message`` for the UI: ``ui_auth`` when given, else the API key as the
    password (any user name) when there is one, else no login."""
    if ui_auth is not None:
        return ui_auth, None
    if api_key is None:
        return None, None
    key = api_key.encode("utf-8", "surrogatepass")

    def check(_user: str, password: str) -> bool:
        return secrets.compare_digest(str(password).encode("utf-8", "surrogatepass"), key)

    return check, API_KEY_LOGIN_MESSAGE


def build_app(
    engine: AsyncLLMEngine | None = None,
    *,
    models: ModelPool | None = None,
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
        models: instead of ``engine``, a many-model server's models (the UI gets a model picker).
        served_model_name: the ``model`` name the API answers to; default ``model_info()["model"]``.
        api_key: when set, the API needs ``Authorization: Bearer <api_key>`` (else 401) and, without
            ``ui_auth``, the UI's login takes it as the password (module docstring).
        ui_auth: ``(user, password)`` for the Gradio UI's login page.
        max_request_bytes: larger request bodies get 413.
        ui_max_queue: Gradio's queue bound (default ``max_waiting``).
        tool_call_parser: the API's tool-call format (``--tool-call-parser``; default: from the chat template).
    Raises:
        ValueError: the engine has no tokenizer; an unknown tool_call_parser.
    """
    app = build_api_app(engine, models=models, served_model_name=served_model_name, api_key=api_key,
                        max_request_bytes=max_request_bytes, tool_call_parser=tool_call_parser)
    max_waiting = engine.max_waiting if engine is not None else (models.engine_config.max_waiting if models else 64)
    blocks = build_ui(engine, max_queue=ui_max_queue or max_waiting, models=models)
    auth, auth_message = ui_login(api_key, ui_auth)
    # No Gradio footer: its "Use via API" opened Gradio's page for its own routes; the UI's API link (webui/app.py)
    # points at /docs, the /v1 API's schema.
    gr.mount_gradio_app(app, blocks, path="/", auth=auth, auth_message=auth_message, ssr_mode=False,
                        footer_links=[], run_history=False, show_error=True)
    app.add_middleware(RefuseUploads)
    if (pace := QueuePace.of(blocks)) is not None:  # Gradio's queue polls often only while the UI is in use
        app.add_middleware(UIActivity, pace=pace)
    return app
