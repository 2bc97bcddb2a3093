"""What the input layer hands on: tokenized prompts, engine-ready requests, and its error type."""

from __future__ import annotations

from dataclasses import dataclass

from lightinfer.sampling_params import SamplingParams


class InputError(ValueError):
    """A bad prompt, message or setting; says what was wrong and what to do.

    Attributes:
        param: the request field at fault when known (``"messages"``, ``"prompt"``), for an API's
            error body; None otherwise.
        code: a machine-readable reason when there is one (``"context_length_exceeded"``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as text and token ids (a rendered chat, or a tokenized / decoded prompt).

    Attributes:
        prompt: the text ("" when the engine has no tokenizer and was given ids).
        prompt_token_ids: the ids the model reads.
    """

    prompt: str
    prompt_token_ids: list[int]


@dataclass
class PoolingParams:
    """The settings of one embedding request (vLLM's name; ``lightinfer/inputs/pooling.py``).

    Attributes:
        dimensions: keep the first ``dimensions`` values of the vector, then normalise again where the model
            normalises (Matryoshka truncation; ``PoolerConfig.output_dimensions`` says which sizes a model
            takes); None: the model's full size (or its sentence-transformers ``truncate_dim``).
    """

    dimensions: int | None = None


@dataclass(frozen=True)
class EngineRequest:
    """One request ready for the engine: ids checked against the vocabulary and the context, settings
    checked against the engine (made by :meth:`lightinfer.inputs.InputProcessor.process`); the engine
    takes it as it is.

    Attributes:
        prompt: the prompt text (for outputs).
        prompt_token_ids: 1..``max_model_len - 1`` ids, each in ``[0, vocab_size)``.
        sampling_params: validated settings (an embedding request's are unused: ``SamplingParams(max_tokens=1)``).
        pooling_params: set on an embedding request (``InputProcessor.process_embedding``): the prompt is
            prefilled and pooled into one vector, no token is sampled; its prompt may then be ``max_model_len``
            ids long. None: a generation request.
    """

    prompt: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    pooling_params: PoolingParams | None = None


# A prompt as callers give it: text, token ids, vLLM's dicts ({"prompt": text} or
# {"prompt_token_ids": ids}), or a prompt the input layer already tokenized.
PromptType = str | list[int] | dict | TokenizedPrompt
