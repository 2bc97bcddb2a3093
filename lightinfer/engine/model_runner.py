"""ModelRunner: owns the model and the KV pool; turns a scheduled step into one flat forward."""

from __future__ import annotations

import logging

import torch

from lightinfer.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from lightinfer.engine.cpu_malloc import tune_malloc_for_cpu_inference
from lightinfer.engine.kv_cache import KVCacheSpec
from lightinfer.engine.scheduler import SchedulerOutput
from lightinfer.layers.attention import Attention, AttentionMetadata, set_context
from lightinfer.loader import Checkpoint, load_weights
from lightinfer.models.registry import get_model_class

logger = logging.getLogger("lightinfer")


class ModelRunner:
    """Loads the model, sizes and allocates the KV pool, runs steps.

    Args:
        config: engine settings (``max_model_len`` already resolved).
        checkpoint: the opened model source.

    Raises:
        ValueError: when one sequence of ``max_model_len`` tokens cannot fit in the KV pool
            (the message gives the numbers and what to lower).
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        if self.device.type == "cpu":
            tune_malloc_for_cpu_inference()  # before the large allocations; see cpu_malloc.py
        hf_config = checkpoint.hf_config
        model_cls = get_model_class(hf_config)
        with torch.device(self.device):
            self.model = model_cls(hf_config, checkpoint.quant_config, self.dtype)
        load_weights(self.model, checkpoint)
        self.model.fuse_projections()  # q/k/v and gate/up as single GEMMs
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.int8
        self.kv_spec = KVCacheSpec(
            num_layers=len(self.attention_layers), num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            block_size=config.block_size, dtype=kv_dtype,
        )
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        if self.device.type == "cpu":
            self.model.pack_for_cpu()  # after weight_bytes: packed tensors are opaque, same size
        self.num_blocks = self._num_blocks()
        self._allocate_kv_cache()

    # ------------------------------------------------------------------ KV pool
    def _kv_budget_bytes(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return int(cfg.kv_cache_memory_bytes)
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_CACHE_BYTES
        # Profile a forward at the full token budget, then give the KV pool what is left.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * cfg.gpu_memory_utilization)
        if cfg.max_vram is not None:
            budget = min(budget, int(cfg.max_vram))
        logger.info("weights %.2f GiB, activation peak %.2f GiB, budget %.2f GiB",
                    self.weight_bytes / 2**30, (peak - self.weight_bytes) / 2**30, budget / 2**30)
        return budget - peak

    def _num_blocks(self) -> int:
        cfg = self.config
        spec = self.kv_spec
        if getattr(cfg, "num_kv_blocks", None):
            num_blocks = int(cfg.num_kv_blocks)
            budget = num_blocks * spec.bytes_per_block
        else:
            budget = self._kv_budget_bytes()
            num_blocks = max(0, budget // spec.bytes_per_block)
        needed = spec.blocks_for(int(cfg.max_model_len))
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache has room for {num_blocks * spec.block_size} tokens ({max(budget, 0) / 2**20:.0f} MiB, "
                f"{spec.bytes_per_token} bytes per token) but one sequence of max_model_len={cfg.max_model_len} "
                f"needs {needed * spec.block_size}; lower max_model_len, use kv_cache_dtype='int8', or give the "
                f"cache more memory (kv_cache_memory_bytes / gpu_memory_utilization / max_vram)"
            )
        fp16_tokens = budget // KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                                             torch.float16).bytes_per_token
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s, %.1f MiB; the same memory holds %d tokens in fp16), "
            "%.1f sequences of max_model_len=%d",
            num_blocks, spec.block_size, num_blocks * spec.block_size, str(spec.dtype).replace("torch.", ""),
            num_blocks * spec.bytes_per_block / 2**20, fp16_tokens, num_blocks * spec.block_size / cfg.max_model_len,
            cfg.max_model_len,
        )
        return int(num_blocks)

    def _allocate_kv_cache(self) -> None:
        for layer in self.attention_layers:
            tensors = self.kv_spec.allocate(self.num_blocks, self.device)
            layer.k_cache, layer.v_cache = tensors["k_cache"], tensors["v_cache"]
            layer.k_scale, layer.k_zero = tensors.get("k_scale"), tensors.get("k_zero")
            layer.v_scale, layer.v_zero = tensors.get("v_scale"), tensors.get("v_zero")

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-fork of a partial block)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for layer in self.attention_layers:
            for t in (layer.k_cache, layer.v_cache, layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero):
                if t is not None:
                    t[dst] = t[src]

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over ``max_num_batched_tokens`` tokens without a cache (peak-memory probe)."""
        n = min(self.config.max_num_batched_tokens, int(self.config.max_model_len))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        set_context(AttentionMetadata(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                                      no_cache=True))
        try:
            hidden = self.model(ids, pos)
            self.model.compute_logits(hidden[-1:])
        finally:
            set_context(None)

    def _prepare(self, out: SchedulerOutput, all_logits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        cu_seqlens = [0]
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        tables = torch.full((len(out.scheduled), max_blocks), -1, dtype=torch.int32)
        num_decodes = out.num_decodes
        # Decodes are laid out by context length: the CPU decode attention groups neighbours
        # (contiguous slices, little padding). Logits rows stay in ``out.scheduled`` order.
        decode_order = sorted(range(num_decodes), key=lambda i: out.scheduled[i].start)
        token_range: dict[int, tuple[int, int]] = {}
        for row, i in enumerate(decode_order + list(range(num_decodes, len(out.scheduled)))):
            s = out.scheduled[i]
            seq, a, b = s.seq, s.start, s.start + s.num_new_tokens
            token_range[i] = (len(input_ids), len(input_ids) + s.num_new_tokens)
            input_ids += seq.token_ids[a:b]
            positions += range(a, b)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(a, b)]
            context_lens.append(b)
            if i >= num_decodes:
                cu_seqlens.append(cu_seqlens[-1] + s.num_new_tokens)
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        logits_idx: list[int] = []
        for i, s in enumerate(out.scheduled):
            first, end = token_range[i]
            if all_logits:
                logits_idx += range(first, end)
            elif s.completes_prompt:
                logits_idx.append(end - 1)
        dev = self.device
        set_context(AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
        ))
        return (torch.tensor(input_ids, dtype=torch.long, device=dev), torch.tensor(positions, device=dev),
                torch.tensor(logits_idx, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        """Run one step.

        Returns:
            fp32 logits ``[num_sampled, vocab]``: one row per scheduled sequence that completes
            its prompt this step (in ``out.scheduled`` order); with ``all_logits`` one row per
            computed token instead.
        """
        self.copy_blocks(out.block_copies)
        input_ids, positions, logits_idx = self._prepare(out, all_logits)
        try:
            hidden = self.model(input_ids, positions)
            return self.model.compute_logits(hidden[logits_idx])
        finally:
            set_context(None)
