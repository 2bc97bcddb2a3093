"""Per-request sampling settings, with the same names and meanings as vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightinfer.structured.spec import StructuredOutputs

# A chat's sampling where the model recommends none (``Checkpoint.sampling_defaults``): the chat UI's starting
# values and the defaults of ``lightinfer chat``, ``pipeline`` and ``LLM.chat``. API requests and
# ``LLM.generate`` keep OpenAI's / vLLM's defaults instead.
CHAT_SAMPLING: dict[str, float] = {"temperature": 0.7, "top_p": 0.95, "top_k": 50}


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Attributes:
        n: completions per prompt; they share the prompt's KV blocks.
        temperature: 0 means greedy; > 0 divides the logits before softmax.
        top_k: keep the k most likely tokens (-1 or 0: all).
        top_p: nucleus sampling, keep the smallest set whose probability mass is >= top_p; in (0, 1].
        min_p: drop tokens whose probability is below ``min_p`` x the top token's; in [0, 1].
        repetition_penalty: CTRL-style (Keskar et al. 2019): logits of tokens seen in the prompt
            or output are divided by it when positive, multiplied when negative; 1 = off.
        presence_penalty: subtracted once from the logit of every token already generated (OpenAI).
        frequency_penalty: subtracted per occurrence of every token already generated (OpenAI).
        seed: per-request generator seed; the tokens are then the same whatever else is batched.
        max_tokens: most new tokens to generate (> 0).
        min_tokens: EOS / stop tokens are suppressed until this many tokens are out.
        stop: strings that end generation; excluded from the returned text.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep going after EOS (benchmarks).
        logprobs: when set, return the top-``logprobs`` log-probabilities of every sampled
            token (the sampled token's own is always included). They are those of the distribution
            the token was drawn from before penalties, temperature and top-k/p: with
            ``structured_outputs``, after the grammar mask (as vLLM reports them), so tokens the
            grammar forbids never show up and the allowed ones share all the probability.
        skip_special_tokens: drop special tokens from the returned text.
        structured_outputs: constrain the output (constrained decoding): a
            :class:`lightinfer.structured.StructuredOutputs`, or a dict of its fields (vLLM's
            ``StructuredOutputsParams`` names): ``{"json": schema}`` (a dict, JSON string or pydantic
            model class; a pydantic class alone means the same), ``{"json_object": True}``,
            ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": lark_or_gbnf}``. A completion that reaches the grammar's end finishes with
            reason "stop"; one cut off by ``max_tokens`` ends with "length" and valid-so-far text.

    Raises:
        ValueError: from :meth:`validate` (called in ``__post_init__``) naming the bad value.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(s, str) for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = [s for s in (self.stop or []) if s]
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, set, frozenset, type(None))):  # a string would split into characters
            raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
                f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = list(ids or [])
        self.validate()

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` saying what was wrong and what is allowed."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)  # a string or NaN would fail (or pass) the range checks below obscurely
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("min_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        # Completion i draws from a generator seeded with seed + i, which torch takes in [-2**63, 2**64).
        if self.seed is not None and not (-(2**63) <= self.seed and self.seed + self.n - 1 < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - n] (a 64-bit seed), got {self.seed}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if self.structured_outputs is not None:
            self.structured_outputs = as_structured_outputs(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        """True when the next token is the arg-max (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1


def as_structured_outputs(value: object) -> StructuredOutputs:
    """``value`` (a :class:`StructuredOutputs`, a dict of its fields, or a pydantic model class) as a
    StructuredOutputs.

    Raises:
        ValueError (:class:`lightinfer.structured.StructuredOutputsError` for a bad constraint): another
            type, unknown keys, or what :class:`StructuredOutputs` refuses.
    """
    from lightinfer.structured.spec import StructuredOutputs  # llguidance loads only when it is used

    if isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic class: its JSON Schema
        return StructuredOutputs(json=value)
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - every bad input is a ValueError here
            f"structured_outputs must be a StructuredOutputs or a dict such as {{'json': schema}}, "
            f"got {type(value).__name__}")
    known = ("json", "json_object", "regex", "choice", "grammar")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {unknown}; use one of {', '.join(known)}")
    return StructuredOutputs(**value)


def recommended_chat_sampling(recommended: Mapping[str, Any]) -> dict[str, float]:
    """A chat's ``temperature`` / ``top_p`` / ``top_k``: the model's recommendation (``recommended``, e.g.
    ``Checkpoint.sampling_defaults()`` = ``model_info()["sampling_defaults"]``) for each setting it gives a
    valid value of, :data:`CHAT_SAMPLING`'s for the rest. Other keys of ``recommended`` are left out."""
    sampling = dict(CHAT_SAMPLING)
    for key, value in recommended.items():
        if key in sampling:
            try:  # a generation_config.json's value out of range (or of the wrong type) is not a failed chat
                value = int(value) if key == "top_k" else float(value)
                SamplingParams(**{key: value})
            except (TypeError, ValueError):
                continue
            sampling[key] = value
    return sampling


def chat_sampling(recommended: Mapping[str, Any], given: Mapping[str, Any] | None = None, max_tokens: int = 16,
                  seed: int | None = None) -> SamplingParams:
    """The sampling of a chat that set none: the settings ``given`` (any :class:`SamplingParams` field), the
    rest of temperature / top_p / top_k from :func:`recommended_chat_sampling`.

    Raises:
        ValueError: a bad ``given`` setting, ``max_tokens`` or ``seed`` (see :meth:`SamplingParams.validate`).
    """
    return SamplingParams(**{"max_tokens": max_tokens, "seed": seed, **recommended_chat_sampling(recommended),
                             **(given or {})})
