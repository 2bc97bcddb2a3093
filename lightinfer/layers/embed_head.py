"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightinfer.layers.cpu_gemm import PackedWeight, can_pack
from lightinfer.layers.weight_forms import LayerDenseWeight, LinearWeight, PackedDenseWeight


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

    def offload_to_host(self) -> None:
        """Move the table to host memory (in place).

        Only rows are gathered from it, one per token, so it need not take GPU memory: 1 GiB
        for Llama-3-8B's 128k x 4096 fp16 table, an eighth of an 8 GiB card (llama.cpp keeps
        its token embeddings on the host too). Gathered rows cross PCIe: 8 KiB per token.
        """
        self.weight = nn.Parameter(self.weight.detach().to("cpu"), requires_grad=False)

    @property
    def on_host(self) -> bool:
        """Whether the table lives in host memory."""
        return self.weight.device.type == "cpu"

    def lookup(self, input_ids: list[int], device: torch.device) -> torch.Tensor:
        """Rows of ``input_ids`` (host ints) -> ``[T, hidden]`` on ``device``: the gather runs
        where the table is, then only the rows move."""
        rows = F.embedding(torch.tensor(input_ids, dtype=torch.long, device=self.weight.device), self.weight)
        return rows.to(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T] int64`` -> ``[T, hidden]`` on ``input_ids``' device (a table on the
        host gathers there: the ids take a round trip, :meth:`lookup` avoids it)."""
        if input_ids.device != self.weight.device:
            return F.embedding(input_ids.to(self.weight.device), self.weight).to(input_ids.device)
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """``hidden [S, hidden]`` -> logits ``[S, vocab]`` in fp32 (the sampler works in fp32)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        # the weight's form (layers/weight_forms.py): the parameter itself, or its oneDNN prepacked copy on a CPU
        self.weight_impl: LinearWeight = LayerDenseWeight(self)

    def pack_for_cpu(self, keep_weight: bool) -> None:
        """Prepack an fp32 CPU weight for the GEMM (``cpu_gemm``, a ``PackedDenseWeight`` form).
        ``keep_weight``: the weight is tied to the embedding, which still needs it (the packed copy
        then costs its size again); otherwise it is released."""
        if self.weight is not None and can_pack(self.weight):
            self.weight_impl = PackedDenseWeight(PackedWeight(self.weight))
            if not keep_weight:
                self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weight_impl.forward(hidden, None).float()
