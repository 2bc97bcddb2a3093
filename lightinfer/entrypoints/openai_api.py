"""The OpenAI-compatible API app: ``/models``, ``/chat/completions``, ``/completions`` (mounted at ``/v1``).

A FastAPI sub-application, so its errors (validation included) come out in OpenAI's error JSON
(:mod:`openai_errors`) without touching the app around it. Each route checks the model, has
:class:`OpenAIServing` prepare the engine requests (off the event loop), submits them, and
answers with :mod:`openai_responses`. A client that disconnects aborts its requests, freeing
their KV blocks. The Anthropic Messages API's routes (``/messages``) join it from :mod:`anthropic_api`.
"""

from __future__ import annotations

import logging
import secrets
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightinfer.entrypoints import openai_responses as R
from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.anthropic_api import register_anthropic_routes
from lightinfer.entrypoints.embeddings_api import register_embeddings_routes
from lightinfer.entrypoints.openai_errors import OpenAIError, error_response, validation_error_response
from lightinfer.entrypoints.openai_serving import SSE_HEADERS, run_until_disconnect
from lightinfer.entrypoints.responses_api import register_responses_routes
from lightinfer.entrypoints.served_models import ServedModels, check_model_name, unknown_model_error

logger = logging.getLogger(__name__)


# Declared through HTTPBearer so that the OpenAPI schema (/docs) says the routes take a Bearer key and offers to
# send one; the check itself is has_api_key's constant-time comparison.
BearerKey = Annotated[HTTPAuthorizationCredentials | None,
                      Depends(HTTPBearer(auto_error=False, description="the server's API key (--api-key)"))]
INVALID_KEY_MESSAGE = "Incorrect API key provided: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
MISSING_KEY_MESSAGE = ("You didn't provide an API key: this server needs one (--api-key); send 'Authorization: "
                       "Bearer <key>' (or 'x-api-key: <key>')")


def key_error_message(request: Request) -> str:
    """The 401's message: no key sent at all, or a key that is not the server's."""
    sent = request.headers.get("authorization") or request.headers.get("x-api-key")
    return INVALID_KEY_MESSAGE if sent else MISSING_KEY_MESSAGE


def has_api_key(request: Request, api_key: str | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <api_key>`` or ``x-api-key: <api_key>`` (Anthropic's
    clients send that one); always True when ``api_key`` is None. Both compared in constant time."""
    if api_key is None:
        return True
    key = api_key.encode("utf-8", "surrogatepass")
    bearer = request.headers.get("authorization", "").encode("utf-8", "surrogatepass")
    x_api_key = request.headers.get("x-api-key")
    return secrets.compare_digest(bearer, b"Bearer " + key) | (
        x_api_key is not None and secrets.compare_digest(x_api_key.encode("utf-8", "surrogatepass"), key))


def _register_routes(app: FastAPI, models: ServedModels) -> None:
    @app.get("/models", response_model=P.ModelList, response_model_exclude_none=True)
    async def list_models() -> P.ModelList:
        """Every model this server answers for, with its context length (``max_model_len``; with several models,
        also whether each is loaded, its format and size)."""
        return P.ModelList(data=models.cards())

    @app.get("/models/{model_id:path}", response_model=P.ModelCard, response_model_exclude_none=True)
    async def get_model(model_id: str) -> P.ModelCard:
        """The model ``model_id`` names, else 404 ``model_not_found``."""
        check_model_name(model_id)
        card = next((c for c in models.cards() if c.id == model_id), None)
        if card is None:
            raise unknown_model_error(model_id, models.names())
        return card

    @app.post("/chat/completions", response_model=None)
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI's Chat Completions, through the model's chat template: ``stream`` (server-sent events),
        ``n``, ``seed``, ``stop``, logprobs, ``response_format`` (JSON schemas), ``tools``, and vLLM's
        sampling extras (``top_k``, ``min_p``, ``repetition_penalty``...)."""
        top = (req.top_logprobs or 0) if req.logprobs else None
        async with models.use(req.model) as serving:
            request, calling = await serving.prepare_chat(req, top)
            subs = await serving.submit([request])
        logger.info("chat request %s: %d prompt tokens, n=%d, stream=%s", subs[0][0],
                    len(request.prompt_token_ids), req.n, req.stream)
        logger.debug("chat request %s messages: %r", subs[0][0], [(m.role, m.text()) for m in req.messages])
        if req.stream:
            return StreamingResponse(R.chat_stream(serving, req, subs, top, calling), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await run_until_disconnect(raw, R.chat_full(serving, req, subs, top, calling), [r for r, _ in subs],
                                          serving.engine)

    @app.post("/completions", response_model=None)
    async def completions(req: P.CompletionRequest, raw: Request) -> Response:
        """OpenAI's legacy Completions: raw prompts (text, token ids, or lists of either), ``echo``,
        ``stream``, ``n``, logprobs, and the same sampling fields as chat."""
        async with models.use(req.model) as serving:
            requests, echo = await serving.prepare_completion(req)
            subs = await serving.submit(requests)
        logger.info("completion request %s: %d prompt(s), n=%d, stream=%s", subs[0][0], len(requests), req.n,
                    req.stream)
        logger.debug("completion request %s prompt: %r", subs[0][0], req.prompt)
        top = req.logprobs
        if req.stream:
            return StreamingResponse(R.completion_stream(serving, req, subs, top, echo),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnect(raw, R.completion_full(serving, req, subs, top, echo),
                                          [r for r, _ in subs], serving.engine)


def api_routes(app: FastAPI, prefix: str = "") -> list[tuple[str, str]]:
    """``(method, path)`` of every route of ``app`` (the ``/v1`` app), paths under ``prefix``, in the order
    registered; path parameters as OpenAPI writes them (``/v1/models/{model_id}``)."""
    return [(method, prefix + route.path_format) for route in app.routes if isinstance(route, APIRoute)
            for method in sorted(route.methods - {"HEAD"})]


def unknown_route_error(app: FastAPI, request: Request, exc: StarletteHTTPException,
                        prefix: str | None = None) -> OpenAIError:
    """The 404 (no such route) or 405 (the route takes another method) of a request to the ``/v1`` app, worded
    as OpenAI words it ("Invalid URL (GET /v1/x)"); the 404 lists the routes there are, so that a client pointed
    at a wrong path (``/v1/chat/completion``, ``/v1/v1/...``) learns the right one. ``prefix``: where ``app``
    is mounted (default: the request's ``root_path``, which is that when the request reached ``app``)."""
    path = request.url.path
    if exc.status_code == 405:
        allowed = " or ".join(m for m in (exc.headers or {}).get("Allow", "").split(", ") if m and m != "HEAD")
        return OpenAIError(405, f"Invalid method for URL ({request.method} {path}): use {allowed}")
    prefix = request.scope.get("root_path", "") if prefix is None else prefix
    listed = ", ".join(f"{m} {p}" for m, p in api_routes(app, prefix))
    known = next((api for end, api in OTHER_APIS.items() if path.rstrip("/").endswith(end)), None)
    hint = f" {known} is not served here: use /v1/chat/completions." if known else ""
    return OpenAIError(404, f"Invalid URL ({request.method} {path}).{hint} The API's routes: {listed}; their "
                            "schema is /openapi.json, browsable at /docs")


# paths of other APIs that clients of this server may try, named in the 404 (an agent's client pointed here)
OTHER_APIS: dict[str, str] = {}


def create_openai_app(models: ServedModels, api_key: str | None = None) -> FastAPI:
    """The ``/v1`` sub-application over the served ``models`` (:mod:`served_models`). ``api_key``: when set,
    every route needs ``Authorization: Bearer <key>``."""

    async def verify_key(request: Request, _: BearerKey) -> None:
        if not has_api_key(request, api_key):
            raise OpenAIError(401, key_error_message(request), code="invalid_api_key")

    # Its schema is served, with the routes around it, at /openapi.json and /docs (entrypoints/server.py).
    app = FastAPI(title="lightinfer OpenAI-compatible API", dependencies=[Depends(verify_key)] if api_key else [],
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # no route raises these itself: the router found no route (or method)
            response = error_response(unknown_route_error(app, request, exc))
            if exc.headers and "Allow" in exc.headers:  # a 405 says which methods the route takes (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, e.g. not UTF-8
            detail = "the request body could not be read as JSON (is it UTF-8 encoded?); send a UTF-8 JSON object"
        return error_response(OpenAIError(exc.status_code, detail))

    _register_routes(app, models)
    register_embeddings_routes(app, models)  # /embeddings (pooling models: lightinfer/entrypoints/embeddings_api.py)
    register_responses_routes(app, models)  # /responses (stateless), through the chat machinery
    register_anthropic_routes(app, models)  # /messages, /messages/count_tokens; their errors in Anthropic's shape
    return app
