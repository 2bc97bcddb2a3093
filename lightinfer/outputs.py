"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` per completion, or for an
embedding request (a pooling engine) ``EmbeddingRequestOutput`` with its ``EmbeddingOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lightinfer.structured.tool_parser import ToolCall


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the ``n`` completions (0-based).
        text: the text so far; streamed ``text`` only ever grows (pieces held back while they
            could still become a stop string or an incomplete UTF-8 character).
        token_ids: generated token ids so far.
        finish_reason: None while running, then "stop" (EOS, stop token, stop string, or the end of a
            ``structured_outputs`` grammar), "length" (max_tokens or the context is full), "abort", or
            (``LLM.chat`` with tools) "tool_calls" when the reply called tools.
        logprobs: when requested, one dict ``{token_id: logprob}`` per generated token.
        cumulative_logprob: sum of the sampled tokens' log-probabilities (when logprobs requested).
        stop_reason: the stop string or stop token id that ended it, if any.
        tool_calls: ``LLM.chat`` with ``tools``: the calls the reply made (``id``, ``name``, ``arguments``
            as a JSON string), ``text`` then holding only the text outside them; None without tools.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of one request's life, and with speculative decoding its
    draft tokens verified and accepted (all its completions)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end).

    Attributes:
        request_id: the caller's id.
        prompt: prompt text (decoded from the ids when the caller gave ids).
        prompt_token_ids: the prompt's token ids.
        outputs: ``n`` completions, in index order.
        finished: all completions finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timing.
    """

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``).

    Attributes:
        data: fp32 ``[dimensions]`` on the CPU: the pooled final hidden state, cut to the request's
            ``dimensions`` and L2-normalised where the model normalises; empty for an aborted request.
    """

    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        """The vector as a list of Python floats (vLLM's ``outputs.embedding``)."""
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        """The vector's length."""
        return int(self.data.shape[-1])


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request (``LLM.embed``; vLLM's ``EmbeddingRequestOutput``).

    Attributes:
        request_id: the caller's id.
        prompt: prompt text (decoded from the ids when the caller gave ids).
        prompt_token_ids: the ids that were embedded.
        outputs: the embedding.
        finished: True once pooled (an embedding request finishes in the step its prompt's prefill ends).
        metrics: timing.
        num_cached_tokens: always 0 (a pooling engine keeps no prefix cache).
    """

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


PoolingRequestOutput = EmbeddingRequestOutput  # vLLM's name of the general kind
