"""Embeddings in the input layer: a pooling model's rules (:class:`PoolerConfig`), an embedding request's
settings (:class:`PoolingParams`), and the refusals that keep generation and embeddings apart.

An engine is either generative or a pooling (embedding) engine (``EngineConfig.runner``): a pooling engine
prefills each prompt, pools its final hidden states into one vector and ends the request, with no token
sampled; it refuses generation requests, and a generative engine refuses embedding requests, each with one
of the messages below.

``dimensions`` (Matryoshka truncation): the pooled vector keeps its first ``dimensions`` values and is then
L2-normalised again when the model normalises (vLLM's order: truncate, then normalise). Any size
``1..hidden_size`` is accepted, unless the model's ``config.json`` lists ``matryoshka_dimensions`` (then only
those) or says ``is_matryoshka: false`` (then none but ``hidden_size``). A sentence-transformers
``truncate_dim`` is the size used when a request gives none.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightinfer.inputs.data import InputError, PoolingParams

__all__ = ["EMBEDDINGS_REFUSED", "GENERATION_REFUSED", "POOLING_TYPES", "PoolerConfig", "PoolingParams"]

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# the refusals, worded once for the input layer, the engine and the HTTP routes
GENERATION_REFUSED = ("this model serves embeddings: use /v1/embeddings (LLM.embed in Python); it was started as a "
                      "pooling model (runner='pooling') and generates no text")
EMBEDDINGS_REFUSED = ("this model generates text and was not started for embeddings: serve an embedding model, or "
                      "start this one with runner='pooling' (CLI: --runner pooling) to embed with it")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling (embedding) model turns a prompt's final hidden states (after the final norm) into one vector.

    Attributes:
        pooling_type: "LAST" (the last prompt token's state: Qwen3-Embedding and other decoder embedders),
            "MEAN" (the mean over every prompt token) or "CLS" (the first token's).
        normalize: L2-normalise the vector (sentence-transformers' ``Normalize`` module).
        hidden_size: the model's hidden size, the vector's length before ``dimensions``.
        matryoshka_dimensions: the only sizes ``dimensions`` may take, when the model lists them; None: any
            ``1..hidden_size`` (module docstring).
        matryoshka: False when the model's config says it was not trained for truncation (``is_matryoshka:
            false``): ``dimensions`` must then be ``hidden_size``.
        default_dimensions: the size a request without ``dimensions`` gets (sentence-transformers'
            ``truncate_dim``); None: ``hidden_size``.
        source: where these rules were read (``modules.json`` + ``1_Pooling/config.json``, or "defaults").
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None
    matryoshka: bool = True
    default_dimensions: int | None = None
    source: str = "defaults"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    def describe(self) -> str:
        """One line for logs: ``"last token, normalised (1_Pooling/config.json)"``."""
        kind = {"LAST": "last token", "MEAN": "mean of the tokens", "CLS": "first token"}[self.pooling_type]
        return f"{kind}, {'normalised' if self.normalize else 'not normalised'} ({self.source})"

    def output_dimensions(self, dimensions: int | None, param: str = "dimensions") -> int:
        """The length of a request's vector: ``dimensions``, else :attr:`default_dimensions`, else ``hidden_size``.

        Raises:
            InputError: naming ``param``: not an integer, outside ``1..hidden_size``, not one of the model's
                ``matryoshka_dimensions``, or any truncation of a model that is not Matryoshka-trained.
        """
        if dimensions is None:
            return self.default_dimensions or self.hidden_size
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise InputError(f"{param} must be an integer, got {dimensions!r}", param=param)
        if not 1 <= dimensions <= self.hidden_size:
            raise InputError(f"{param} must be between 1 and {self.hidden_size} (this model's embedding size), got "
                             f"{dimensions}", param=param)
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions \
                and dimensions != self.hidden_size:
            sizes = ", ".join(str(d) for d in self.matryoshka_dimensions)
            raise InputError(f"{param} {dimensions} is not one this model was trained to be cut to; use one of "
                             f"{sizes} (config.json matryoshka_dimensions)", param=param)
        if not self.matryoshka and dimensions != self.hidden_size:
            raise InputError(f"this model was not trained for shorter embeddings (config.json is_matryoshka: false); "
                             f"leave {param} out or give {self.hidden_size}", param=param)
        return dimensions
