"""The HTTP server's app: the OpenAI API at ``/v1``, ``/health``, ``/metrics``, ``/stats``, and their OpenAPI
schema at ``/openapi.json`` (browsable at ``/docs`` and ``/redoc``).

Everything shares one ``AsyncLLMEngine`` (one engine loop, one continuous batch). The chat UI is
mounted at ``/`` by the layer above (``lightinfer.webui.server.build_app``), so the API never
depends on the UI. Security defaults: bind 127.0.0.1; ``api_key`` guards every route but ``/health`` and
the schema pages (``/v1``, ``/metrics``, ``/stats``: Bearer; the UI: its login, see ``webui/server.py``); request
bodies are capped; prompts and replies are logged only at DEBUG level. A wrong path under ``/v1`` gets OpenAI's
404 ("Invalid URL (GET /v1/x)") listing the routes there are.

``/stats`` is the engine's counters as JSON (running / waiting requests, KV blocks free and in use,
preemptions, prefix-cache hits, batch sizes, token totals, and ``cpu_decode_replay``: which CPU decode batch
sizes are replayed from recordings and why the others run eagerly): what the UI's engine panel shows, for
scripts and tests; ``/metrics`` has the counters and the request latencies for Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.api_docs import add_swagger_ui
from lightinfer.entrypoints.http_limits import HTTPLimits, uvicorn_config
from lightinfer.entrypoints.metrics import ServingMetrics
from lightinfer.entrypoints.model_pool import ModelPool
from lightinfer.entrypoints.openai_api import (
    create_openai_app,
    has_api_key,
    key_error_message,
    unknown_route_error,
)
from lightinfer.entrypoints.openai_errors import OpenAIError, error_response
from lightinfer.entrypoints.openai_serving import OpenAIServing
from lightinfer.entrypoints.pool_routes import add_pool_routes
from lightinfer.entrypoints.served_models import ServedModels, SingleModel

logger = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 32k-token chat is ~150 KB of JSON: 4 MiB is generous


class BodySizeLimitMiddleware:
    """Refuse HTTP request bodies over ``max_bytes`` with 413 (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # chunked upload past the limit: the app sees a disconnect
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_bytes} bytes (--max-request-bytes)"
        path = scope.get("path", "")
        if path.startswith("/v1/messages"):  # the Anthropic routes answer in Anthropic's error shape
            body: dict[str, Any] = {"type": "error", "error": {"type": "request_too_large", "message": message}}
        else:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": "request_too_large"}}
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def build_api_app(
    engine: AsyncLLMEngine | None = None,
    *,
    models: ModelPool | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Assemble the API server; the engine loop (or the pool's loading) starts and stops with the app's lifespan.

    Args:
        engine: the shared async engine of a one-model server (not yet started is fine).
        models: instead of ``engine``, the models of a many-model server (:class:`ModelPool`); adds
            ``POST /models/load`` and ``/models/unload`` (``{"model": NAME}``), and ``/stats`` lists every model.
        served_model_name: the ``model`` name the API answers to; default ``model_info()["model"]`` (one model).
        api_key: when set, ``/v1``, ``/metrics``, ``/stats`` and ``/models/*`` need the key (``Authorization:
            Bearer <api_key>`` or ``x-api-key``; else 401); ``/health`` stays open.
        max_request_bytes: larger request bodies (to any route, a UI mounted later included) get 413.
        tool_call_parser: the tool-call format (``--tool-call-parser``); None: detected from the chat template.
    Returns:
        the app; more routes or mounts (the UI at ``/``) may be added before it starts.
    Raises:
        ValueError: neither or both of engine and models; the engine has no tokenizer; an unknown tool_call_parser.
    """
    if (engine is None) == (models is None):
        raise ValueError("build_api_app takes an engine or a model pool, not both")
    served: ServedModels
    if engine is not None:
        name = served_model_name or str(engine.model_info()["model"])
        metrics = ServingMetrics(engine, model_name=name)
        served = SingleModel(OpenAIServing(engine, name, tool_call_parser))
    else:
        assert models is not None
        pool = models
        metrics = ServingMetrics(sources=lambda: [(n, e.engine) for n, e in pool.entries.items()
                                                  if e.engine is not None])
        pool.add_load_listener(metrics.attach)
        name, served = ", ".join(pool.names()), pool

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            engine.start()
            logger.info("engine loop started; serving %s", name)
            yield
            engine.shutdown()
            return
        assert models is not None
        await models.start()
        logger.info("serving %d models (%s), each loaded when a request names it", len(models.names()), name)
        yield
        await models.close()

    # /openapi.json, /docs and /redoc describe this app's routes and the /v1 app's (openapi_schema below);
    # they are matched before the chat UI mounted at "/", whose own schema would describe Gradio's routes.
    # /docs from the installed Swagger UI bundle where there is one (api_docs.py: FastAPI's page needs a CDN)
    local_docs = importlib.util.find_spec("swagger_ui_bundle") is not None
    app = FastAPI(title="lightinfer", lifespan=lifespan, docs_url=None if local_docs else "/docs",
                  redoc_url="/redoc", openapi_url="/openapi.json")
    if local_docs:
        add_swagger_ui(app, "lightinfer")
    app.state.engine, app.state.models, app.state.metrics = engine, models, metrics

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs (with several models: every loaded model's; load balancers poll this),
        else 503."""
        if (engine or models).is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    def unauthorized(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": key_error_message(request), "type": "invalid_request_error",
                                       "param": None, "code": "invalid_api_key"}}, status_code=401)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus metrics (Bearer key when the server has one: Prometheus' ``authorization`` setting)."""
        if not has_api_key(request, api_key):
            return unauthorized(request)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/stats")
    async def stats(request: Request) -> Response:
        """The engine's counters as JSON (module docstring); Bearer key when the server has one."""
        if not has_api_key(request, api_key):
            return unauthorized(request)
        body = vars(engine.get_stats()) if engine is not None else models.stats()
        return Response(json.dumps(body), media_type="application/json")

    if models is not None:
        add_pool_routes(app, models, api_key)

    @app.api_route("/models/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def other_model_routes(request: Request, rest: str) -> Response:
        """What is not ``POST /models/load`` or ``/models/unload`` of a many-model server: OpenAI's error shape with
        what there is (without this route a UI mounted at "/" would answer, in its own words)."""
        if models is None:
            return error_response(OpenAIError(404, f"{request.method} {request.url.path}: loading and unloading "
                                                   "models by hand is for a server of several models (lightinfer "
                                                   "serve A B ..., or --models-dir); this server keeps its one model "
                                                   "loaded. The models it serves: GET /v1/models"))
        if rest in ("load", "unload"):
            return error_response(OpenAIError(405, f"use POST /models/{rest} with a JSON body {{\"model\": NAME}}"))
        return error_response(OpenAIError(404, f"{request.method} {request.url.path}: no such route; this server has "
                                               "POST /models/load and POST /models/unload (body {\"model\": NAME}) "
                                               "and GET /v1/models"))

    # Routes above and /v1 are matched before a catch-all mount at "/" added later (the chat UI).
    v1 = create_openai_app(served, api_key)

    @app.api_route("/v1", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def v1_root(request: Request) -> Response:
        """``/v1`` itself (no route there): the /v1 app's 404, listing its routes. Without this route a UI
        mounted at "/" would answer it, in its own words."""
        return error_response(unknown_route_error(v1, request, StarletteHTTPException(404), prefix="/v1"))

    app.mount("/v1", v1)
    app.openapi = lambda: openapi_schema(app, {"/v1": v1})  # type: ignore[method-assign]
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    return app


def openapi_schema(app: FastAPI, mounts: dict[str, FastAPI]) -> dict[str, Any]:
    """The OpenAPI schema of ``app``'s own routes and those of the FastAPI apps mounted in it at the paths
    of ``mounts`` (FastAPI's schema leaves mounted apps out), built once and cached on ``app``.

    The mounted apps' paths come first, under their mount path (``/v1/chat/completions``), tagged with it;
    their components (request and response models, the Bearer scheme) join ``app``'s.
    """
    if app.openapi_schema is not None:
        return app.openapi_schema
    from importlib.metadata import PackageNotFoundError, version

    from fastapi.openapi.utils import get_openapi

    try:
        __version__ = version("lightinfer")
    except PackageNotFoundError:  # a checkout run without installing
        __version__ = "unknown"
    schema = get_openapi(
        title="lightinfer", version=__version__, routes=app.routes,
        description="lightinfer's OpenAI-compatible API under /v1 (any OpenAI client works with "
                    "base_url=http://HOST:PORT/v1) and the server's /health, /metrics and /stats.")
    paths: dict[str, Any] = {}
    for prefix, sub in mounts.items():
        part = get_openapi(title=sub.title, version=__version__, routes=sub.routes)
        for path, item in part.get("paths", {}).items():
            paths[prefix + path] = {method: {**op, "tags": [prefix]} for method, op in item.items()}
        for kind, entries in part.get("components", {}).items():
            schema.setdefault("components", {}).setdefault(kind, {}).update(entries)
    for path, item in schema.get("paths", {}).items():
        paths[path] = {method: {**op, "tags": ["server"]} for method, op in item.items()}
    schema["paths"] = paths
    app.openapi_schema = schema
    return schema


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info", limits: HTTPLimits | None = None,
               **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` with uvicorn until interrupted (blocking), under the connection ``limits``
    (:class:`~lightinfer.entrypoints.http_limits.HTTPLimits`: timeouts for idle and half-sent
    connections, a cap on connections at once), on :class:`~lightinfer.entrypoints.quiet_server.QuietServer`:
    an idle server's event loop wakes once a second, not ten times."""
    from lightinfer.entrypoints.quiet_server import QuietServer

    config = uvicorn_config(app, host, port, limits, log_level, timeout_graceful_shutdown=5, **uvicorn_kwargs)
    QuietServer(config).run()
