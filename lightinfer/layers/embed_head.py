"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.layers.cpu_gemm import PackedWeight, can_pack


class VocabEmbedding(nn.Module):
    """``input_ids [T] int64`` -> ``[T, hidden]``.

    Raises:
        ValueError: an id outside ``[0, vocab_size)`` (checked by the engine before any work;
            checked here again because a bad id would read out of bounds on a GPU).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """``hidden [S, hidden]`` -> logits ``[S, vocab]`` in fp32 (the sampler works in fp32)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self._packed: PackedWeight | None = None

    def pack_for_cpu(self, keep_weight: bool) -> None:
        """Prepack an fp32 CPU weight for the GEMM (``cpu_gemm``). ``keep_weight``: the weight
        is tied to the embedding, which still needs it (the packed copy then costs its size
        again); otherwise it is released."""
        if self.weight is not None and can_pack(self.weight):
            self._packed = PackedWeight(self.weight)
            if not keep_weight:
                self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return self._packed(hidden).float()
        return F.linear(hidden, self.weight).float()
