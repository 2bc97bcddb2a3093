"""``POST /models/load`` and ``POST /models/unload`` of a many-model server (llama.cpp's router mode spells them
so): load or unload a model by hand, body ``{"model": NAME}``; the answer is the model's ``/v1/models`` entry.
Under the server's API key, like ``/stats``. Errors come in OpenAI's error shape."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from lightinfer.entrypoints.model_pool import ModelPool
from lightinfer.entrypoints.openai_api import has_api_key, key_error_message
from lightinfer.entrypoints.openai_errors import OpenAIError, error_response


class ModelAction(BaseModel):
    """The body of ``/models/load`` and ``/models/unload``."""

    model_config = ConfigDict(extra="forbid")
    model: str


async def _read_action(request: Request) -> ModelAction:
    try:
        return ModelAction.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise OpenAIError(400, f"send a JSON body {{\"model\": NAME}} naming a served model ({where}: "
                               f"{first.get('msg')})", param=where or None) from None


def add_pool_routes(app: FastAPI, pool: ModelPool, api_key: str | None) -> None:
    """Add ``/models/load`` and ``/models/unload`` for ``pool`` to ``app`` (module docstring)."""

    async def act(request: Request, unload: bool) -> JSONResponse:
        if not has_api_key(request, api_key):
            return error_response(OpenAIError(401, key_error_message(request), code="invalid_api_key"))
        try:
            action = await _read_action(request)
            entry = await (pool.unload(action.model) if unload else pool.load(action.model, retry=True))
        except OpenAIError as exc:
            return error_response(exc)
        card = next(c for c in pool.cards() if c.id == entry.name)
        return JSONResponse(card.model_dump(exclude_none=True))

    @app.post("/models/load")
    async def load_model(request: Request) -> JSONResponse:
        """Load a model now (body ``{"model": NAME}``), unloading the least recently used idle one if there is no
        room; answers when it is loaded, with its ``/v1/models`` entry. 404 unknown name, 503 it failed to load."""
        return await act(request, unload=False)

    @app.post("/models/unload")
    async def unload_model(request: Request) -> JSONResponse:
        """Unload a model now (body ``{"model": NAME}``), giving its memory back. 409 while it has requests."""
        return await act(request, unload=True)
