"""The models an API server answers for, by the ``model`` name a request gives.

Every API route (OpenAI Chat / Completions / Responses, Anthropic Messages, embeddings) reaches a model the
same way::

    async with models.use(req.model) as serving:      # 404 for an unknown name; loads an unloaded model
        request, calling = await serving.prepare_chat(req, top)
        subs = await serving.submit([request])
    # stream or collect ``subs`` here, outside the block

Inside the block the model cannot be unloaded; once its requests are submitted its engine counts them
(``AsyncLLMEngine.num_unfinished``), which keeps it loaded until they end. :class:`SingleModel` is the
one-model server (``lightinfer serve MODEL``); :class:`lightinfer.entrypoints.model_pool.ModelPool` serves
several, loading on demand.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from lightinfer.entrypoints import protocol as P
from lightinfer.entrypoints.openai_errors import OpenAIError
from lightinfer.entrypoints.openai_serving import OpenAIServing
from lightinfer.inputs.text import check_text


def check_model_name(model: Any) -> str:
    """``model`` as given, when it is Unicode text.

    Raises:
        OpenAIError: 400 (param ``model``) for text that is not Unicode (a lone surrogate).
    """
    try:
        check_text(model, "model")
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="model") from None
    return model


def unknown_model_error(model: str, names: list[str]) -> OpenAIError:
    """OpenAI's 404 ``model_not_found`` for ``model``, listing the served ``names``."""
    served = ", ".join(f"`{n}`" for n in names)
    return OpenAIError(404, f"The model `{model}` does not exist; this server serves {served}", param="model",
                       code="model_not_found")


class ServedModels(Protocol):
    """What the API routes need of the served models (module docstring)."""

    default_name: str  # the model a route without a ``model`` field uses (the UI's first choice)

    def names(self) -> list[str]:
        """Every name a request may give, in the order listed by ``/v1/models``."""
        ...

    def cards(self) -> list[P.ModelCard]:
        """``/v1/models``' entries, one per name."""
        ...

    def use(self, model: str) -> Any:
        """An async context manager yielding the model's :class:`OpenAIServing` (loading it first if needed).

        Raises (on entering):
            OpenAIError: 404 ``model_not_found`` (listing the served names), 400 for a non-text name, 503 when
                the model failed to load (the message says why).
        """
        ...

    def engines(self) -> list[Any]:
        """The loaded models' ``AsyncLLMEngine`` objects (for ``/health``, ``/stats``, metrics)."""
        ...


class SingleModel:
    """The one-model server: ``serving`` under its name, always loaded.

    Args:
        serving: the model's request preparation (over its engine).
    """

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.default_name = serving.model_name

    def names(self) -> list[str]:
        return [self.serving.model_name]

    def cards(self) -> list[P.ModelCard]:
        return [P.ModelCard(id=self.serving.model_name, max_model_len=self.serving.max_model_len)]

    @asynccontextmanager
    async def use(self, model: str) -> AsyncIterator[OpenAIServing]:
        if check_model_name(model) != self.serving.model_name:
            raise unknown_model_error(model, self.names())
        yield self.serving

    def engines(self) -> list[Any]:
        return [self.serving.engine]
