"""Pooling: a prompt's final hidden states (after the final norm) -> one embedding vector.

A prompt may be prefilled in several chunks (chunked prefill), so pooling is in two parts: each step,
:func:`pool_step` takes what the step's rows contribute per sequence (LAST: the prompt's last row, in the step
that ends the prompt; CLS: its first row, in the step that starts it; MEAN: the sum of the chunk's rows); the
engine adds a sequence's parts up and :func:`finish_embedding` turns the total into the vector (MEAN: divided
by the prompt's length; then cut to ``dimensions`` and L2-normalised where the model normalises). Sums and the
vector are fp32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PoolSpan:
    """One scheduled sequence's rows in a step's hidden states.

    Attributes:
        first: its first row; end: one past its last row.
        starts_prompt: the chunk starts at the prompt's first token.
        ends_prompt: the chunk ends the prompt.
    """

    first: int
    end: int
    starts_prompt: bool
    ends_prompt: bool


def pool_step(hidden: torch.Tensor, spans: list[PoolSpan], pooling_type: str) -> list[torch.Tensor | None]:
    """What each span contributes to its sequence's vector this step.

    Args:
        hidden: ``[num_rows, hidden]`` final hidden states of the step (any float dtype, any device).
        spans: the step's sequences' rows.
        pooling_type: "LAST", "MEAN" or "CLS" (:class:`lightinfer.inputs.pooling.PoolerConfig`).
    Returns:
        per span, fp32 ``[hidden]`` on ``hidden``'s device, or None where the span contributes nothing (LAST
        before the prompt's last chunk, CLS after its first); MEAN: the sum of the span's rows.
    Raises:
        ValueError: an unknown ``pooling_type``.
    """
    if pooling_type == "MEAN":
        owner = torch.cat([torch.full((s.end - s.first,), i, dtype=torch.long) for i, s in enumerate(spans)])
        rows = torch.cat([torch.arange(s.first, s.end) for s in spans]).to(hidden.device)
        sums = torch.zeros(len(spans), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner.to(hidden.device), hidden.index_select(0, rows).float())
        return list(sums.unbind(0))
    if pooling_type == "LAST":
        picked = [(i, s.end - 1) for i, s in enumerate(spans) if s.ends_prompt]
    elif pooling_type == "CLS":
        picked = [(i, s.first) for i, s in enumerate(spans) if s.starts_prompt]
    else:
        raise ValueError(f"unknown pooling type {pooling_type!r}; LAST, MEAN or CLS")
    out: list[torch.Tensor | None] = [None] * len(spans)
    if picked:
        index = torch.tensor([row for _, row in picked], dtype=torch.long, device=hidden.device)
        for (i, _), vec in zip(picked, hidden.index_select(0, index).float().unbind(0)):
            out[i] = vec
    return out


def finish_embedding(total: torch.Tensor, num_tokens: int, pooling_type: str, dimensions: int,
                     normalize: bool) -> torch.Tensor:
    """One sequence's vector from the sum of its :func:`pool_step` parts.

    Args:
        total: fp32 ``[hidden]``: the pooled state (LAST / CLS) or the sum over every prompt token (MEAN).
        num_tokens: the prompt's length (MEAN divides by it).
        pooling_type: "LAST", "MEAN" or "CLS".
        dimensions: keep the first ``dimensions`` values (Matryoshka), 1..hidden.
        normalize: L2-normalise after cutting (as vLLM: the cut vector is a unit vector again).
    Returns:
        fp32 ``[dimensions]`` on the CPU.
    """
    vec = total.float()
    if pooling_type == "MEAN":
        vec = vec / max(num_tokens, 1)
    vec = vec[:dimensions]
    if normalize:
        vec = F.normalize(vec, p=2.0, dim=-1)
    return vec.cpu()
