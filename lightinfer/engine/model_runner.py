"""ModelRunner: owns the model and the KV pool; turns a scheduled step into one flat forward."""

from __future__ import annotations

import logging

import torch

from lightinfer.config import EngineConfig
from lightinfer.dummy_weights import init_dummy_weights
from lightinfer.engine.cpu_graph import CpuDecodeGraphRunner
from lightinfer.engine.cpu_threads import CpuThreads
from lightinfer.engine.cuda_graph import DecodeGraphRunner, graph_batch_sizes
from lightinfer.engine.kv_groups import KVGroup, kv_groups_of
from lightinfer.engine.load_progress import LoadProgress
from lightinfer.engine.memory import decode_split_reserve_bytes, describe_kv_groups, split_kv_pool
from lightinfer.engine.moe_placement import host_expert_layers, moe_startup_report
from lightinfer.engine.platform import Platform, platform_for
from lightinfer.engine.scheduler import SchedulerOutput
from lightinfer.engine.step_inputs import StepInputs, block_table_tensor, build_step_inputs, select_rows
from lightinfer.kernels import KVCacheSpec, switches
from lightinfer.layers.attention import Attention, AttentionMetadata, KVGroupTables, set_context
from lightinfer.layers.embed_head import VocabEmbedding
from lightinfer.layers.fusion import fuse_model
from lightinfer.layers.linear import W4A16Linear, W8A16Linear
from lightinfer.layers.moe import FusedMoE, experts_in_host_memory
from lightinfer.layers.pooler import PoolSpan, pool_step
from lightinfer.layers.weight_forms import weight_form
from lightinfer.loader import Checkpoint, load_weights
from lightinfer.models.registry import get_model_class

logger = logging.getLogger("lightinfer")


class ModelRunner:
    """Loads the model, sizes and allocates the KV pool, runs steps.

    Args:
        config: the engine's resolved settings (``EngineConfig.resolve``: dtype, device, ``max_model_len`` and the
            kernel settings decided).
        checkpoint: the opened model source.
        progress: the loading phases' progress lines.

    Construction is one sequence: load -> prepare weights -> measure -> allocate KV -> capture / record, with
    what differs by device in ``self.platform`` (``platform.py``), all of it under the config's kernel settings
    (``EngineConfig.kernel_switches``: the weights are prepared for them). On CUDA without ``enforce_eager``,
    decode-only steps replay CUDA graphs (``cuda_graph.py``), on a CPU their recorded C calls (``cpu_graph.py``);
    everything else runs eagerly.

    Raises:
        ValueError: when the weights and fixed costs exceed the memory budget, or one sequence of
            ``max_model_len`` tokens cannot fit in the KV pool (the message gives the numbers and what to change);
            a config that is not resolved.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, progress: LoadProgress | None = None) -> None:
        progress = progress or LoadProgress(enabled=False)
        if not config.resolved:
            raise ValueError("ModelRunner takes a resolved config (EngineConfig.resolve, as LLMEngine makes it)")
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.platform: Platform = platform_for(self.device)
        # a CPU engine's thread count: fixed, or adapted per step to what other processes leave (cpu_threads.py);
        # set by the platform
        self.cpu_threads: CpuThreads | None = None
        # why no CPU decode step is replayed, or why batches above the recorded sizes are not (cpu_graph.py);
        # set by the CPU platform
        self.cpu_replay_off: str | None = None
        self.cpu_replay_above: str | None = None
        # The input embedding when it lives in host memory on a GPU engine (rows gathered there).
        self.host_embedding: VocabEmbedding | None = None
        with switches.override(**config.kernel_switches()):
            self.platform.prepare_process(self)
            self._load(checkpoint, progress)
            self.platform.prepare_weights(self, progress)
            self._measure_weights()
            with progress.phase("allocating the KV cache"):
                self.group_num_blocks = self._num_blocks()
                self._allocate_kv_cache()
            self.platform.prepare_steps(self)
            if config.runner == "pooling":  # prefills only: nothing to replay
                replay = None
                self.cpu_replay_off = self.cpu_replay_off or "a pooling (embedding) engine runs no decode steps"
            else:
                replay = self.platform.graph_runner(self, progress)
        self.graph_runner: DecodeGraphRunner | None = replay if isinstance(replay, DecodeGraphRunner) else None
        self.cpu_graph_runner: CpuDecodeGraphRunner | None = \
            replay if isinstance(replay, CpuDecodeGraphRunner) else None

    def _load(self, checkpoint: Checkpoint, progress: LoadProgress) -> None:
        """Check the memory, build the model (MoE experts placed), load (or draw) its weights, fuse its projections,
        and describe its attention layers' KV cache (``kv_spec``, ``kv_groups``)."""
        config, hf_config = self.config, checkpoint.hf_config
        model_cls = get_model_class(hf_config)
        self.platform.check_memory(self, model_cls, checkpoint)
        # MoE: the experts of the first cpu_experts MoE layers are built in host memory (engine/moe_placement.py)
        self.host_expert_layers = host_expert_layers(model_cls, hf_config, config.cpu_experts)
        dtype = str(self.dtype).replace("torch.", "")
        with progress.phase(f"building the model ({dtype} on {self.device})"), torch.device(self.device), \
                experts_in_host_memory(self.host_expert_layers):
            self.model = model_cls(hf_config, checkpoint.quant_config, self.dtype)
            if config.runner == "pooling":  # embeddings read the final hidden states: no LM head loaded or kept
                self.model.drop_lm_head()
        # module -> how its weights were loaded ("W4 (GPTQ, g128)", "dense"...), for model_info()
        self.weight_formats: dict[str, str] = {}
        with progress.phase("loading the weights"):
            if config.load_format == "dummy":
                init_dummy_weights(self.model, config.seed)
            else:
                self.weight_formats = load_weights(self.model, checkpoint)
            fuse_model(self.model)  # q/k/v and gate/up as single GEMMs; split-K sums left to the op that follows
        self.model.set_max_model_len(int(config.max_model_len))  # rotary tables cut to it, LongRoPE fixed for it
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.int8
        # All layers' cache (what a token costs); per KV-cache group (sliding-window layers apart), the pools.
        self.kv_spec = KVCacheSpec(
            num_layers=len(self.attention_layers), num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
            block_size=config.block_size, dtype=kv_dtype,
        )
        self.kv_groups: list[KVGroup] = kv_groups_of(self.attention_layers, int(config.max_model_len),
                                                     config.block_size, kv_dtype)

    def _measure_weights(self) -> None:
        """What the prepared weights hold (``weight_bytes``, ``host_weight_bytes``, ``cpu_dense_bytes``,
        ``cpu_expert_bytes``), and the MoE start-up advice."""
        # What the weights hold, prepared forms included (released expert stacks, meta tensors, count 0); of it,
        # what the CPU path's GEMM forms add (the part estimate_weight_bytes predicts as cpu_dense): the MoE
        # experts' part is their prepared copies less the W4 stacks those released (0 for int4 copies).
        self.weight_bytes, self.host_weight_bytes = resident_weight_bytes(self.model, self.device)
        self.cpu_expert_bytes = sum(m.cpu_added_nbytes() for m in self.model.modules() if isinstance(m, FusedMoE))
        self.cpu_dense_bytes = dequantized_linear_bytes(self.model) + self.cpu_expert_bytes
        # The card advice compares run-time layouts: what the experts' CPU copies add (host memory on a GPU engine)
        # left out, which puts the released stacks back at their run-time size.
        device_copies = self.cpu_expert_bytes if self.device.type == "cpu" else 0
        moe_report = moe_startup_report(self.model, self.weight_bytes - device_copies,
                                        self.host_weight_bytes - (self.cpu_expert_bytes - device_copies),
                                        self.kv_spec.bytes_per_token, int(self.config.max_model_len),
                                        self.config.gpu_memory_utilization)
        if moe_report:
            logger.info("%s", moe_report)

    # ------------------------------------------------------------------ KV pool
    def _kv_budget_bytes(self) -> tuple[int, str]:
        """Bytes for the KV pool and the memory plan behind them: the platform's (``Platform.kv_budget_bytes``:
        on CUDA the GPU memory plan, on a CPU ``kv_cache_memory_bytes`` or a fixed default).

        Raises:
            ValueError: the weights or all fixed costs exceed the budget (``memory.py``).
        """
        return self.platform.kv_budget_bytes(self)

    def activation_peak(self, num_tokens: int | None) -> int:
        """Peak bytes a cache-free forward of ``num_tokens`` (None: the step budget) allocates
        beyond what is already allocated (CUDA only)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        self.profile_run(num_tokens)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    @property
    def num_blocks(self) -> int:
        """Blocks of KV-cache group 0's pool (the only pool of a model without sliding windows)."""
        return self.group_num_blocks[0]

    @property
    def kv_windows(self) -> list[int | None]:
        """Each KV-cache group's sliding window (None: full attention), for the block manager."""
        return [g.window for g in self.kv_groups]

    def _num_blocks(self) -> list[int]:
        """Blocks per KV-cache group: ``num_kv_blocks`` each, or the budget split between the groups
        (``memory.split_kv_pool``)."""
        cfg = self.config
        spec = self.kv_spec
        report = ""
        needs = [g.need(int(cfg.max_model_len), cfg.max_num_batched_tokens) for g in self.kv_groups]
        if getattr(cfg, "num_kv_blocks", None):
            counts = [int(cfg.num_kv_blocks)] * len(needs)
            budget = sum(n * g.bytes_per_block for n, g in zip(counts, needs))
        else:
            budget, report = self._kv_budget_bytes()
            counts = split_kv_pool(budget, needs)
        short = [(n, g) for n, g in zip(counts, needs) if n < g.blocks_per_sequence]
        if short:
            n, g = short[0]
            raise ValueError(
                f"the KV cache has room for {n * spec.block_size} tokens in {g.name} "
                f"({max(budget, 0) / 2**20:.0f} MiB in all, {spec.bytes_per_token} bytes per token over all layers) "
                f"but one sequence of max_model_len={cfg.max_model_len} needs {g.blocks_per_sequence * spec.block_size} "
                f"there; lower max_model_len, use kv_cache_dtype='int8', or give the cache more memory "
                f"(kv_cache_memory_bytes / gpu_memory_utilization / max_vram)" + (f"\n{report}" if report else "")
            )
        if len(needs) > 1:
            report = "\n".join(x for x in (report, describe_kv_groups(needs, counts, spec.block_size)) if x)
        num_blocks = counts[0] if len(needs) == 1 else sum(counts)
        fp16_tokens = budget // KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                                             torch.float16).bytes_per_token
        dtype = str(spec.dtype).replace("torch.", "")
        # What INT8 buys, said only for an INT8 cache (a 16-bit one would compare with itself).
        saving = f"; the same memory holds {fp16_tokens} tokens in fp16" if spec.is_int8 else ""
        if report:  # CUDA (one block, the KV pool line is the plan's last), or several KV-cache groups
            logger.info("%s\n  KV cache dtype %s%s", report, dtype, saving)
        else:
            logger.info(
                "KV cache: %d blocks x %d tokens = %d tokens (%s, %.1f MiB%s), %.1f sequences of max_model_len=%d",
                num_blocks, spec.block_size, num_blocks * spec.block_size, dtype,
                num_blocks * spec.bytes_per_block / 2**20, saving, num_blocks * spec.block_size / cfg.max_model_len,
                cfg.max_model_len,
            )
        return counts

    def _allocate_kv_cache(self) -> None:
        # Per KV-cache group, one tensor per kind for its layers, each layer's PagedKV contiguous views of them
        # (KVCacheSpec).
        for group, num_blocks in zip(self.kv_groups, self.group_num_blocks):
            caches = group.spec.allocate_layers(len(group.layers), num_blocks, self.device)
            for i, kv in zip(group.layers, caches):
                self.attention_layers[i].kv_cache = kv

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy whole KV blocks ``(group, src, dst)`` in every layer of that group (copy-on-fork of a partial block)."""
        for g, group in enumerate(self.kv_groups):
            pairs = [(s, d) for grp, s, d in copies if grp == g]
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            for i in group.layers:
                self.attention_layers[i].kv_cache.copy_blocks(src, dst)

    def _decode_split_bytes(self) -> int:
        """The split decode kernel's fp32 partials at the captured batch sizes (the largest of
        them: the graphs share one pool). Graphs pass block tables as wide as max_model_len, so
        these buffers grow with it; an eager profiling forward has none of them."""
        spec, heads = self.kv_spec, self.attention_layers[0].num_heads
        max_ctx = spec.blocks_for(int(self.config.max_model_len)) * spec.block_size
        return decode_split_reserve_bytes(graph_batch_sizes(self.max_decode_batch()), heads, spec.num_kv_heads,
                                          spec.head_dim, max_ctx, self.device)

    # ------------------------------------------------------------------ decode graphs
    def max_decode_batch(self) -> int:
        """Most decodes one step can hold: one token each, so the token budget caps them too."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def build_graph_runner(self, use_cuda_graphs: bool) -> DecodeGraphRunner:
        """A decode graph runner sized for this engine (not captured yet). ``use_cuda_graphs=False``
        gives the eager static-buffer twin, which tests attach on a CPU."""
        return DecodeGraphRunner(
            self.model, self.max_decode_batch(), self.kv_spec.blocks_for(int(self.config.max_model_len)),
            self.model.config.hidden_size, self.dtype, self.device, use_cuda_graphs,
            host_embedding=self.host_embedding, num_kv_groups=len(self.kv_groups),
        )

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def profile_run(self, num_tokens: int | None = None) -> None:
        """Peak-memory probe: a forward over ``num_tokens`` tokens (default the step budget,
        ``max_num_batched_tokens``) without a cache, cut into sequences of at most
        ``max_model_len``, then logits and a softmax for as many rows as one step can sample."""
        cfg = self.config
        n = num_tokens or cfg.max_num_batched_tokens
        seq_len = min(n, int(cfg.max_model_len))
        bounds = [*range(0, n, seq_len), n]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % seq_len
        set_context(AttentionMetadata(cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32, device=self.device),
                                      no_cache=True))
        try:
            hidden = self.model(ids, pos)
            if self.model.has_lm_head:  # a pooling engine's model has none
                torch.softmax(self.model.compute_logits(hidden[-min(n, cfg.max_num_seqs):]), dim=-1)
        finally:
            set_context(None)

    def _upload(self, step: StepInputs) -> torch.Tensor:
        """Set the attention context of ``step`` for an eager forward; returns its positions,
        int64 ``[num_tokens]`` on the device."""
        dev = self.device
        width = step.max_num_blocks
        tables = block_table_tensor(step.block_tables, len(step.block_tables), width, fill=-1)
        others = tuple(KVGroupTables(torch.tensor(g.slot_mapping, dtype=torch.long, device=dev),
                                     block_table_tensor(g.block_tables, len(g.block_tables), width, fill=-1).to(dev),
                                     step.num_decodes) for g in step.other_groups)
        set_context(AttentionMetadata(
            num_decodes=step.num_decodes,
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            context_lens=torch.tensor(step.context_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            cu_seqlens_q=torch.tensor(step.cu_seqlens_q, dtype=torch.int32, device=dev),
            other_groups=others,
        ))
        return torch.tensor(step.positions, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, all_logits: bool = False) -> torch.Tensor:
        """Run one step: a decode-only step of at most the largest captured batch replays a CUDA
        graph (when there are graphs), anything else runs eagerly.

        Returns:
            fp32 logits ``[num_sampled, vocab]``: one row per scheduled sequence that completes
            its prompt this step (in ``out.scheduled`` order), on the device; with ``all_logits``
            one row per computed token instead, on the CPU (computed ``max_num_seqs`` rows at a
            time: a whole chunk's logits, e.g. 2,048 x 128k x 4 bytes, are outside the memory plan).
        """
        if self.cpu_threads is not None:
            self.cpu_threads.before_step()
        self.copy_blocks(out.block_copies)
        step = build_step_inputs(out, all_logits, self.config.block_size, len(self.kv_groups))
        try:
            if self.graph_runner is not None and not all_logits and self.graph_runner.can_run(step):
                hidden = self.graph_runner.run(step)
            elif self.cpu_graph_runner is not None and not all_logits and self.cpu_graph_runner.can_run(step):
                hidden = self.cpu_graph_runner.run(step)
            else:
                hidden = self._forward_eager(step)
            if all_logits:
                rows = self.config.max_num_seqs
                logits_idx = torch.tensor(step.logits_idx, dtype=torch.long, device=self.device)
                return torch.cat([self.model.compute_logits(hidden[logits_idx[i: i + rows]]).cpu()
                                  for i in range(0, len(step.logits_idx), rows)])
            return self.model.compute_logits(select_rows(hidden, step.logits_idx))
        finally:
            set_context(None)

    def _forward_eager(self, step: StepInputs) -> torch.Tensor:
        """One eager forward of ``step`` (its attention context set here): final hidden states ``[rows, hidden]``."""
        positions = self._upload(step)
        if self.host_embedding is not None:  # gather on the host from the step's ids
            return self.model(None, positions, self.host_embedding.lookup(step.input_ids, self.device))
        return self.model(torch.tensor(step.input_ids, dtype=torch.long, device=self.device), positions)

    @torch.inference_mode()
    def pool(self, out: SchedulerOutput, pooling_type: str) -> list[torch.Tensor | None]:
        """Run one step of a pooling engine (eagerly; no LM head) and pool its final hidden states
        (``layers/pooler.pool_step``).

        Returns:
            per scheduled sequence (``out.scheduled`` order), what its rows add to its vector: fp32 ``[hidden]``
            on the device, or None (LAST before the prompt's last chunk, CLS after its first).
        """
        if self.cpu_threads is not None:
            self.cpu_threads.before_step()
        self.copy_blocks(out.block_copies)
        step = build_step_inputs(out, False, self.config.block_size, len(self.kv_groups))
        try:
            hidden = self._forward_eager(step)
            spans = [PoolSpan(first, end, s.start == 0, s.completes_prompt)
                     for s, (first, end) in zip(out.scheduled, step.seq_rows)]
            return pool_step(hidden, spans, pooling_type)
        finally:
            set_context(None)


def resident_weight_bytes(model: torch.nn.Module, device: torch.device) -> tuple[int, int]:
    """``(bytes on device, bytes in host memory)`` the loaded model's weights really hold: its tensors, each
    storage once (a tied head counts once), plus what the linears' weight forms hold beside them
    (``LinearWeight.nbytes()``, ``layers/weight_forms.py``: the forms ``pack_for_cpu`` prepared for the CPU GEMM,
    which replace or join the layer's tensors) and a MoE layer's expert copies (``FusedMoE.prepared_nbytes``). A
    tensor on the ``meta`` device (a W4 expert stack released once its CPU copy replaced it,
    ``FusedMoE.pack_for_cpu``) holds nothing and counts 0. On a GPU engine the host part is the input embedding
    kept on the host and the ``--cpu-experts`` experts (their prepared copies)."""
    storages = {t.data_ptr(): t for t in model.state_dict().values() if t.device.type != "meta"}
    on_device = host = 0
    for t in storages.values():
        if t.device.type == device.type:
            on_device += t.numel() * t.element_size()
        else:
            host += t.numel() * t.element_size()
    for m in model.modules():
        form = weight_form(m)
        extra = 0 if form is None else form.nbytes()
        if isinstance(m, FusedMoE):  # only experts that compute on the CPU have copies: host memory on a GPU engine
            extra += m.prepared_nbytes()
        if device.type == "cpu":
            on_device += extra
        else:
            host += extra
    return on_device, host


def dequantized_linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copies of the 4-/8-bit linears' weights the CPU path holds in another precision, beside or
    instead of their codes: the weight forms that are not the codes in another layout (``LinearWeight.same_codes``
    False: dequantized for the fp32 engine's exact GEMM, prepacked or plain ``[out, in]``, or an 8-bit LM head
    requantized per row); ``linear_nbytes``' ``cpu_dense`` and ``quant_embed.table_cpu_copy_nbytes`` predict
    them."""
    forms = (weight_form(m) for m in model.modules() if isinstance(m, (W4A16Linear, W8A16Linear)))
    return sum(form.nbytes() for form in forms if form is not None and not form.same_codes)
