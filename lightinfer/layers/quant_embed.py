"""Token embedding and LM head over a quantized table (a GGUF file's Q8_0 / Q6_K / Q4_K ``token_embd``
and ``output`` tensors), without a 16- or 32-bit copy of the table.

The table is a ``W4A16Linear`` or ``W8A16Linear`` with ``out_features = vocab`` and
``in_features = hidden``: the LM head is exactly that layer's GEMM, and an embedding lookup
dequantizes only the looked-up rows. With tied embeddings both modules hold the same table.
The loader swaps these in for ``VocabEmbedding`` / ``LMHead`` (``lightinfer.formats.gguf_load``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightinfer.formats.scheme import LINEAR_FORMATS_KEY
from lightinfer.kernels import dequantize_w4
from lightinfer.kernels.cpu_lowbit import int8_per_channel_nbytes, int8pack_takes
from lightinfer.layers.cpu_gemm import use_cpu_lowbit
from lightinfer.layers.linear import W4A16Linear, stays_lowbit_on_cpu
from lightinfer.layers.w8_linear import W8A16Linear


def dequantize_rows(table: W4A16Linear | W8A16Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``) of ``table``'s weight, dequantized: ``[T, hidden]`` in fp32 (W8)
    or the scales' dtype (W4)."""
    if isinstance(table, W8A16Linear):
        return table.rows(ids)
    return dequantize_w4(table.qweight.index_select(0, ids), table.scales.index_select(1, ids),
                         table.zeros.index_select(1, ids))


class QuantizedVocabEmbedding(nn.Module):
    """``input_ids [T] int64`` -> ``[T, hidden]`` in ``dtype``, from a quantized table (module docstring).

    Same interface as ``VocabEmbedding`` (``lookup``, ``offload_to_host``, ``on_host``).

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """

    def __init__(self, table: W4A16Linear | W8A16Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        table.rows_read = True  # the CPU engine's pack_for_cpu keeps the codes this embedding reads
        self.vocab_size = table.out_features
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        """Where the table lives."""
        return self.table.device if isinstance(self.table, W8A16Linear) else self.table.qweight.device

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def offload_to_host(self) -> None:
        """Move the quantized table to host memory (in place); looked-up rows are dequantized there."""
        self.table.to("cpu")

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")
        return dequantize_rows(self.table, ids).to(self.dtype)

    def lookup(self, input_ids: list[int], device: torch.device) -> torch.Tensor:
        """Rows of ``input_ids`` (host ints) -> ``[T, hidden]`` on ``device``."""
        return self._rows(torch.tensor(input_ids, dtype=torch.long, device=self.device)).to(device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(input_ids.to(self.device)).to(input_ids.device)


class QuantizedLMHead(nn.Module):
    """``hidden [S, hidden]`` -> fp32 logits ``[S, vocab]`` through the table's own GEMM."""

    def __init__(self, table: W4A16Linear | W8A16Linear) -> None:
        super().__init__()
        self.table = table
        if isinstance(table, W8A16Linear):
            table.lm_head = True  # the CPU engine requantizes it per row for the int8 GEMM (pack_for_cpu)

    def pack_for_cpu(self, keep_weight: bool) -> None:
        """On CPU the table is prepared once for the GEMM (``pack_for_cpu`` of its layer); ``keep_weight``
        is moot: a tied table's codes stay because the embedding marks them as read (``rows_read``)."""
        del keep_weight
        self.table.pack_for_cpu()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.table(hidden)
        return (out.reduced() if hasattr(out, "reduced") else out).float()


def table_cpu_copy_nbytes(quant_config: dict | None, vocab_size: int, hidden_size: int, tied: bool,
                          dtype: torch.dtype) -> int:
    """Bytes of the dense copies a CPU engine with activations in ``dtype`` keeps of the quantized embedding / LM
    head tables (what ``engine.model_runner.dequantized_linear_bytes`` counts of them), by arithmetic: nothing
    is built.

    The tables are a GGUF file's quantized ``token_embd`` / ``output`` (the loader swaps them in: they are named
    ``model.embed_tokens`` / ``lm_head`` in ``quant_config``'s per-module map; a tied head shares the embedding's
    table). ``pack_for_cpu`` (``W4A16Linear`` / ``W8A16Linear``) then keeps, per table of ``vocab_size x
    hidden_size`` weights:

    * a dequantized copy in ``dtype`` where it does not stay low-bit (fp32 activations, the ``cpu_lowbit``
      switch off, or a shape torch's int4 GEMM cannot take: ``layers.linear.stays_lowbit_on_cpu``);
    * else, for a W8 table an LM head multiplies by (an untied ``lm_head``, or a tied embedding), its copy
      requantized per row for the int8 GEMM (``kernels.cpu_lowbit.int8_per_channel_nbytes``; the codes stay
      where an embedding reads rows);
    * else nothing (a W4 table keeps its codes beside the low-bit form; those are stored bytes, not a copy; a
      W8 table only an embedding reads keeps its codes and nothing else).

    Returns:
        bytes (0 for a model whose tables are dense).
    """
    formats = (quant_config or {}).get(LINEAR_FORMATS_KEY) or {}
    if str((quant_config or {}).get("quant_method", "")).lower() != "gguf":
        return 0  # only the GGUF loader builds quantized tables
    elem = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for name in ("model.embed_tokens", "lm_head"):
        fmt = formats.get(name)
        if fmt is None or fmt.kind == "dense" or (name == "lm_head" and tied):
            continue
        head = name == "lm_head" or tied
        if fmt.kind == "w8" and head and use_cpu_lowbit(dtype) and int8pack_takes(hidden_size):
            total += int8_per_channel_nbytes(vocab_size, hidden_size)
        elif not stays_lowbit_on_cpu(fmt, vocab_size, hidden_size, dtype) and (head or fmt.kind == "w4"):
            total += vocab_size * hidden_size * elem
    return total
