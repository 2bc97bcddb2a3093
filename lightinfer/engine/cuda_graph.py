"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel launches (a few hundred per forward,
each a few microseconds of CPU time), not by the GPU. A CUDA graph records the launches once
per batch size and replays them with one call. Graphs bake in every pointer and shape, so the
forward runs on static buffers, sized for the largest batch, and a step's batch is padded up
to the next captured size::

    captured sizes   1 2 4 8 16 32 48 64 ... (multiples of 16 after 16), up to max_num_seqs
    static rows      [ real rows 0..n-1 | padding rows n..bs-1 ]
    padding row      input_id 0, position 0, slot -1 (the KV store skips it),
                     context_len 1, block table all 0 (attends to slot 0 of block 0:
                     finite values, the row's output is discarded)

A model with several KV-cache groups (sliding-window layers, ``block_manager.py``) has a slot mapping and
a block table buffer per group.

Only the model forward ``model(input_ids, positions) -> hidden`` is captured; the LM head and
the sampler run eagerly on the real rows. Without ``use_cuda_graphs`` the same static-buffer
path runs the model eagerly (CPU tests of the padding, filling and slicing logic).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from lightinfer.engine.step_inputs import StepInputs, block_table_tensor
from lightinfer.layers.attention import AttentionMetadata, KVGroupTables, set_context
from lightinfer.layers.embed_head import VocabEmbedding

logger = logging.getLogger("lightinfer")

SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16  # above 8: every multiple of 16, as vLLM does (padding <= 15 rows)


class CudaGraphCaptureError(RuntimeError):
    """Capturing the decode graphs failed, so the engine did not start (:meth:`ModelRunner._capture_graphs`)."""


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to the first one that is
    >= ``max_batch_size`` (so every decode batch of up to ``max_batch_size`` has a graph).

    Raises:
        ValueError: ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    step = BATCH_SIZE_STEP
    candidates = [*SMALL_BATCH_SIZES, *range(step, max_batch_size + step, step)]
    sizes: list[int] = []
    for size in candidates:
        sizes.append(size)
        if size >= max_batch_size:
            break
    return sizes


class DecodeGraphRunner:
    """Static buffers plus one captured forward per padded batch size.

    Args:
        model: the causal LM; ``model(input_ids [T] int64, positions [T] int64) -> [T, hidden]``.
        max_batch_size: most decodes in one step (``min(max_num_seqs, max_num_batched_tokens)``).
        max_blocks_per_seq: block table width, ``ceil(max_model_len / block_size)``.
        hidden_size: width of the model's output.
        dtype: the model's activation dtype.
        device: where the buffers live.
        use_cuda_graphs: capture and replay graphs (CUDA only); False runs the model eagerly on
            the static buffers.
        host_embedding: the model's input embedding when its table is in host memory: the
            rows are gathered on the host into a static ``inputs_embeds`` buffer before each
            replay, and the graph starts after the embedding (a host gather cannot be captured).
        num_kv_groups: KV-cache groups (one slot mapping and block table buffer each).
        batch_sizes: the sizes a batch is padded to, ascending (default :func:`graph_batch_sizes`).

    Static buffers (``max_bs`` = the largest captured size): ``input_ids``, ``positions``,
    ``slot_mapping`` int64 ``[max_bs]``, ``context_lens`` int32 ``[max_bs]``, ``block_tables``
    int32 ``[max_bs, max_blocks_per_seq]``, ``hidden`` ``[max_bs, hidden_size]`` in ``dtype``
    (``slot_mappings[g]`` / ``group_block_tables[g]`` per KV-cache group; group 0's are the two above).

    Raises:
        ValueError: ``use_cuda_graphs`` on a non-CUDA device.
    """

    def __init__(
        self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, hidden_size: int,
        dtype: torch.dtype, device: torch.device, use_cuda_graphs: bool,
        host_embedding: VocabEmbedding | None = None, num_kv_groups: int = 1,
        batch_sizes: list[int] | None = None,
    ) -> None:
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.batch_sizes = batch_sizes or graph_batch_sizes(max_batch_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs
        max_bs = self.batch_sizes[-1]
        # The static inputs are views of two flat buffers, each filled on the host (pinned memory on
        # CUDA) and uploaded by one asynchronous copy per step, where one synchronous pageable copy per
        # tensor each waited for the stream (5 per step).
        #   i64: [input_ids | positions | slot_mapping of each group], max_bs each
        #   i32: [context_lens (max_bs) | block_tables of each group (max_bs x max_blocks_per_seq, row-major)]
        pin = device.type == "cuda"
        self.num_kv_groups = num_kv_groups
        g = num_kv_groups
        self._host_i64 = torch.zeros((2 + g) * max_bs, dtype=torch.long, pin_memory=pin)
        self._host_i32 = torch.zeros(max_bs * (1 + g * max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self._i64 = torch.zeros_like(self._host_i64, device=device)
        self._i32 = torch.zeros_like(self._host_i32, device=device)
        self.input_ids, self.positions, *self.slot_mappings = self._i64.view(2 + g, max_bs).unbind(0)
        self.slot_mapping = self.slot_mappings[0]
        self.context_lens = self._i32[:max_bs]
        self.group_block_tables = list(self._i32[max_bs:].view(g, max_bs, max_blocks_per_seq).unbind(0))
        self.block_tables = self.group_block_tables[0]
        self._uploaded: torch.cuda.Event | None = None  # the last upload, on CUDA (its host buffers are busy)
        self._pad_all_rows()
        self.hidden = torch.zeros((max_bs, hidden_size), dtype=dtype, device=device)
        self.host_embedding = host_embedding
        self.inputs_embeds = (torch.zeros((max_bs, hidden_size), dtype=dtype, device=device)
                              if host_embedding is not None else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0  # steps that went through this runner (tests, stats)

    @property
    def max_batch_size(self) -> int:
        """The largest captured batch size (rows of the static buffers)."""
        return self.batch_sizes[-1]

    def padded_batch_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` decodes is padded to; None when too large."""
        return next((bs for bs in self.batch_sizes if bs >= num_seqs), None)

    def can_run(self, step: StepInputs) -> bool:
        """Whether ``step`` is a decode-only batch this runner holds (size and table width)."""
        n = len(step.input_ids)
        return (0 < n == step.num_decodes and n <= self.max_batch_size
                and step.max_num_blocks <= self.max_blocks_per_seq)

    # ------------------------------------------------------------------ buffers
    def _pad_all_rows(self) -> None:
        """Every static row a padding row (module docstring), on the host and on the device."""
        h64 = self._host_i64.view(2 + self.num_kv_groups, self.max_batch_size)
        h64[:2].zero_()
        h64[2:].fill_(-1)
        self._host_i32.zero_()
        self._host_i32[:self.max_batch_size].fill_(1)
        self._i64.copy_(self._host_i64)
        self._i32.copy_(self._host_i32)

    def load(self, step: StepInputs) -> int:
        """Copy ``step``'s decodes into the static buffers, padding up to a captured size.

        Returns:
            The padded batch size ``bs``; rows ``[len(step.input_ids), bs)`` are padding.
        Raises:
            ValueError: ``step`` is not a decode-only batch this runner holds (:meth:`can_run`).
        """
        if not self.can_run(step):
            raise ValueError(f"not a decode batch of <= {self.max_batch_size} sequences with <= "
                             f"{self.max_blocks_per_seq} blocks each: {len(step.input_ids)} tokens, "
                             f"{step.num_decodes} decodes, {step.max_num_blocks} blocks")
        n = len(step.input_ids)
        bs = self.padded_batch_size(n)
        assert bs is not None
        pad = bs - n
        max_bs, table_width = self.max_batch_size, self.max_blocks_per_seq
        if self._uploaded is not None:
            self._uploaded.synchronize()  # normally long done: the last step's tokens were read back
        ids = step.input_ids + [0] * pad
        g = self.num_kv_groups
        slots = [step.slot_mapping, *(o.slot_mapping for o in step.other_groups)]
        tables = [step.block_tables, *(o.block_tables for o in step.other_groups)]
        if len(slots) != g:
            raise ValueError(f"a step with {len(slots)} KV-cache groups for a runner built for {g}")
        h64 = self._host_i64.view(2 + g, max_bs)
        h64[:, :bs] = torch.tensor([ids, step.positions + [0] * pad, *(s + [-1] * pad for s in slots)],
                                   dtype=torch.long)
        h32 = self._host_i32
        h32[:bs] = torch.tensor(step.context_lens + [1] * pad, dtype=torch.int32)
        # Only the step's widest table is written: a row's entries past its context are never read
        # (the kernels bound every read by context_lens), so stale ones may stay there.
        width = step.max_num_blocks
        group_tables = h32[max_bs:].view(g, max_bs, table_width)
        for i, t in enumerate(tables):
            group_tables[i, :bs, :width] = block_table_tensor(t, bs, width, fill=0)
        self._i64.copy_(self._host_i64, non_blocking=True)
        # context_lens and every group's tables (the first bs rows of the last one end the range)
        used = max_bs + (g - 1) * max_bs * table_width + bs * table_width
        self._i32[:used].copy_(self._host_i32[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        if self.host_embedding is not None:
            self.inputs_embeds[:bs].copy_(self.host_embedding.lookup(ids, self.device))
        return bs

    def _forward(self, bs: int) -> None:
        """The model on the first ``bs`` static rows, output into ``self.hidden[:bs]`` (the
        body that is captured; also the warm-up, and the whole run of a runner without graphs)."""
        self.hidden[:bs].copy_(self._model_forward(bs))

    def _model_forward(self, bs: int) -> torch.Tensor:
        """The model on the first ``bs`` static rows: ``[bs, hidden]``, the model's own output tensor."""
        set_context(AttentionMetadata(
            num_decodes=bs, slot_mapping=self.slot_mapping[:bs], context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs], cu_seqlens_q=None,
            other_groups=tuple(KVGroupTables(s[:bs], t[:bs], bs)
                               for s, t in zip(self.slot_mappings[1:], self.group_block_tables[1:])),
        ))
        try:
            if self.inputs_embeds is not None:
                return self.model(None, self.positions[:bs], self.inputs_embeds[:bs])
            return self.model(self.input_ids[:bs], self.positions[:bs])
        finally:
            set_context(None)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """Run ``step`` (see :meth:`can_run`) through the static buffers.

        Returns:
            ``[num_decodes, hidden]`` hidden states in row order of ``step``: a view of the
            static output, valid until the next :meth:`run`.
        """
        bs = self.load(step)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._forward(bs)
        self.num_runs += 1
        return self.hidden[: len(step.input_ids)]

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, all in one memory pool.

        Each size runs once eagerly first: Triton compiles a kernel at its first launch for a
        new specialization (row counts, alignments), and compiling is not allowed during
        capture. Largest first: the pool then holds the largest batch's activations and every
        smaller graph reuses those blocks. No-op without ``use_cuda_graphs``.
        """
        if not self.use_cuda_graphs:
            return
        self._pad_all_rows()  # the warm-up runs write nothing into the KV cache (slot -1)
        start = time.perf_counter()
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up
        torch.cuda.synchronize(self.device)
        # torch.cuda.graph() empties the allocator's cache on entry; do it here first so that the
        # reserved-memory delta below is the graphs' pool alone.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs: captured %d decode batch sizes %s in %.1f s, %.0f MiB of GPU memory",
                    len(self.graphs), self.batch_sizes, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(self.device) - reserved_before) / 2**20)
