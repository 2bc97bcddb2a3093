"""Platform: what an engine does differently on each kind of device (CUDA GPUs, CPUs).

The model runner builds an engine in one sequence (load -> prepare weights -> measure -> allocate KV ->
capture / record, ``model_runner.py``); each step that differs by device asks the runner's :class:`Platform`:

=====================  =========================================  ==============================================
step                   :class:`CudaPlatform`                      :class:`CpuPlatform`
=====================  =========================================  ==============================================
``prepare_process``    the current CUDA device (Triton launches,   glibc malloc tuned for large tensors
                       graph capture)                             (``cpu_malloc.py``), every usable core for
                                                                  loading
``check_memory``       nothing: the KV plan measures the GPU      the host-memory estimate, before anything is
                                                                  built (``memory.check_host_memory``)
``prepare_weights``    the input embedding to host memory         each linear prepared once for the CPU GEMM
                       (``embedding_on_host``), ``--cpu-experts``  (``pack_for_cpu``)
                       experts' CPU form
``kv_budget_bytes``    the GPU memory plan: budget less weights,  ``kv_cache_memory_bytes``, else a fixed
                       activation peak, graphs, non-torch memory  default
``prepare_steps``      nothing                                    the steps' thread count (``threads``,
                                                                  ``cpu_threads.py``)
``graph_runner``       CUDA graphs of decode steps                recorded C calls of decode steps
                       (``cuda_graph.py``)                        (``cpu_graph.py``)
=====================  =========================================  ==============================================

Adding a platform (another accelerator): subclass :class:`Platform`, implement these methods for its device
(a memory budget, its graph mechanism or None), return it from :func:`platform_for` for its ``torch.device``
type, and let ``config.resolve_device`` accept that type.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from lightinfer.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from lightinfer.engine.cpu_graph import (
    NOT_A_CPU_ENGINE,
    CpuDecodeGraphRunner,
    eager_above,
    log_replay_plan,
    replay_report,
    replay_unavailable,
)
from lightinfer.engine.cpu_malloc import tune_malloc_for_cpu_inference
from lightinfer.engine.cpu_threads import CpuThreads
from lightinfer.engine.cuda_graph import CudaGraphCaptureError, DecodeGraphRunner, graph_batch_sizes
from lightinfer.engine.kv_groups import KVGroup
from lightinfer.engine.load_progress import LoadProgress
from lightinfer.engine.memory import (
    available_host_bytes,
    check_host_memory,
    check_weights_fit,
    embedding_stays_on_host,
    graph_reserve_bytes,
    plan_kv_pool,
)
from lightinfer.engine.moe_placement import prepare_host_experts
from lightinfer.kernels import KVCacheSpec, cpu_native
from lightinfer.layers.embed_head import VocabEmbedding
from lightinfer.layers.ops import backend_name
from lightinfer.loader import Checkpoint
from lightinfer.models.base import CausalLM

logger = logging.getLogger("lightinfer")


class ModelRunner(Protocol):
    """What a platform reads and sets on the model runner it serves (``model_runner.ModelRunner``), step by step:
    ``config``, ``device``, ``dtype`` from the start; ``model``, ``host_expert_layers``, ``kv_spec``,
    ``kv_groups`` once loaded; ``host_embedding`` is the platform's to set (``prepare_weights``)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    host_expert_layers: set[int]
    host_embedding: VocabEmbedding | None
    kv_spec: KVCacheSpec
    kv_groups: list[KVGroup]
    cpu_threads: CpuThreads | None
    cpu_replay_off: str | None
    cpu_replay_above: str | None

    def activation_peak(self, num_tokens: int | None) -> int: ...

    def max_decode_batch(self) -> int: ...

    def _decode_split_bytes(self) -> int: ...

    def build_graph_runner(self, use_cuda_graphs: bool) -> DecodeGraphRunner: ...


class Platform:
    """The device-specific steps of building an engine (module docstring). Stateless: every method takes the
    runner (its resolved ``config``, ``device``, ``model``...), so one instance serves any number of engines.

    Attributes:
        name: the ``torch.device`` type this platform serves ("cuda", "cpu").
    """

    name = ""

    def prepare_process(self, runner: ModelRunner) -> None:
        """Process settings that must come before the model is built (device, allocator, threads)."""
        raise NotImplementedError

    def check_memory(self, runner: ModelRunner, model_cls: type, checkpoint: Checkpoint) -> None:
        """Refuse, before anything is built, a model the device's memory cannot hold.

        Raises:
            ValueError: the figures and what to change.
        """
        raise NotImplementedError

    def prepare_weights(self, runner: ModelRunner, progress: LoadProgress) -> None:
        """Turn the loaded weights into the forms this device multiplies by (once, before measuring); may set
        ``runner.host_embedding``."""
        raise NotImplementedError

    def kv_budget_bytes(self, runner: ModelRunner) -> tuple[int, str]:
        """Bytes for the KV pool and the memory plan behind them ("" where there is no plan to show).

        Raises:
            ValueError: the weights or all fixed costs exceed the budget (``memory.py``).
        """
        raise NotImplementedError

    def prepare_steps(self, runner: ModelRunner) -> None:
        """Process settings for the steps, once loading is over."""

    def uses_graphs(self, runner: ModelRunner) -> bool:
        """Whether decode steps replay a captured or recorded form (``graph_runner`` builds it)."""
        return False

    def graph_runner(self, runner: ModelRunner, progress: LoadProgress) -> DecodeGraphRunner | CpuDecodeGraphRunner | None:
        """The decode steps' replayed form for this device, ready to run, or None (eager steps)."""
        return None

    def same_numerics_rows(self, runner: ModelRunner, rows: int) -> int:
        """The most rows a decode step may carry and still multiply each row as a step of ``rows`` rows does,
        bit for bit (speculative decoding adds its drafts as rows only up to it, so that greedy output stays
        the same: ``engine/spec/``). Here: no limit known (the device's kernels are taken as row-independent)."""
        return 1 << 30


class CudaPlatform(Platform):
    """A CUDA GPU: the GPU memory plan decides the KV pool, decode steps replay CUDA graphs."""

    name = "cuda"

    def prepare_process(self, runner: ModelRunner) -> None:
        torch.cuda.set_device(runner.device)  # Triton launches and graph capture use the current device, not the tensors'
        runner.cpu_replay_off = NOT_A_CPU_ENGINE  # (model_info()["cpu_decode_replay"])

    def check_memory(self, runner: ModelRunner, model_cls: type, checkpoint: Checkpoint) -> None:
        pass  # the GPU's budget is checked on the loaded model (kv_budget_bytes: check_weights_fit, plan_kv_pool)

    def prepare_weights(self, runner: ModelRunner, progress: LoadProgress) -> None:
        if embedding_stays_on_host(True, runner.model.tie_word_embeddings, runner.config.embedding_on_host):
            runner.model.embed_tokens.offload_to_host()  # freed on the GPU before the budget is measured
            runner.host_embedding = runner.model.embed_tokens
        prepare_host_experts(runner.model)  # --cpu-experts: their CPU GEMM form, once

    def kv_budget_bytes(self, runner: ModelRunner) -> tuple[int, str]:
        """``budget = min(total * gpu_memory_utilization, max_vram)`` minus what the loaded model holds, the
        activation peak of a forward at ``max_num_batched_tokens``, the CUDA graphs' reserve and the memory
        outside torch's allocator (``memory.py``); ``kv_cache_memory_bytes`` when set."""
        cfg, dev = runner.config, runner.device
        if cfg.kv_cache_memory_bytes is not None:
            return int(cfg.kv_cache_memory_bytes), ""
        total = torch.cuda.get_device_properties(dev).total_memory
        budget = int(total * cfg.gpu_memory_utilization)
        note = f"{total / 2**30:.1f} GiB x gpu_memory_utilization {cfg.gpu_memory_utilization:g}"
        if cfg.max_vram is not None and int(cfg.max_vram) < budget:
            budget, note = int(cfg.max_vram), f"max_vram {cfg.max_vram / 2**30:.2f} GiB"
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        # What the model really holds (weights, fused copies, rotary tables), not the state-dict sum.
        resident = torch.cuda.memory_allocated(dev)
        check_weights_fit(budget, resident, note)  # before profiling: a too-small card fails here
        activations = runner.activation_peak(None)
        graphs = 0
        if self.uses_graphs(runner):
            # The graphs' pool is private: the eager steps' activations (regular pool) cannot
            # reuse it, so it is reserved on top of them. Its size is what the largest decode
            # batch's forward allocates; measured eagerly on that many tokens (plus a margin).
            largest = graph_batch_sizes(runner.max_decode_batch())[-1]
            graphs = graph_reserve_bytes(runner.activation_peak(largest)) + runner._decode_split_bytes()
        # Measured after the forwards: the first matmul creates cuBLAS's workspace, the first
        # launch of each kernel loads its module; none of it goes through torch's allocator.
        # Other processes on the GPU count too (they take memory this engine cannot have).
        free, device_total = torch.cuda.mem_get_info(dev)
        non_torch = (device_total - free) - torch.cuda.memory_reserved(dev)
        num_blocks, report = plan_kv_pool(
            budget, resident, activations, non_torch, graphs, runner.kv_spec.bytes_per_block, cfg.block_size,
            int(cfg.max_model_len), note,
        )
        return num_blocks * runner.kv_spec.bytes_per_block, report

    def uses_graphs(self, runner: ModelRunner) -> bool:
        # Experts computed on the CPU (--cpu-experts) cannot be captured: such engines decode eagerly.
        return not runner.config.enforce_eager and not runner.host_expert_layers

    def graph_runner(self, runner: ModelRunner, progress: LoadProgress) -> DecodeGraphRunner | None:
        """The captured decode graphs.

        Raises:
            CudaGraphCaptureError: capture failed (e.g. an op in the forward synchronized with the host). A
                failed capture can leave torch's stream and graph memory pool half-captured, so decoding eagerly
                in the same process is not a safe fallback: the message says to start with ``enforce_eager``.
        """
        if not self.uses_graphs(runner):
            return None
        with progress.phase("capturing the decode CUDA graphs"):
            graphs = runner.build_graph_runner(use_cuda_graphs=True)
            try:
                graphs.capture()
            except RuntimeError as err:
                raise CudaGraphCaptureError(
                    f"capturing the decode CUDA graphs failed ({err}); start the engine with enforce_eager=True "
                    f"(CLI: --enforce-eager) to run without CUDA graphs") from err
        return graphs


class CpuPlatform(Platform):
    """A CPU: a host-memory check before building, weights prepared for the CPU GEMM, a fixed KV default, decode
    steps replayed as recorded C calls."""

    name = "cpu"

    def prepare_process(self, runner: ModelRunner) -> None:
        tune_malloc_for_cpu_inference()  # before the large allocations; see cpu_malloc.py
        # the steps' thread count: fixed, or adapted per step to what other processes leave (cpu_threads.py);
        # loading (the weights' CPU preparation) takes every usable core
        runner.cpu_threads = CpuThreads(runner.config.threads)
        runner.cpu_threads.for_loading()

    def check_memory(self, runner: ModelRunner, model_cls: type, checkpoint: Checkpoint) -> None:
        check_host_memory(self.memory_parts(runner, model_cls, checkpoint), available_host_bytes())

    @staticmethod
    def memory_parts(runner: ModelRunner, model_cls: type, checkpoint: Checkpoint) -> dict[str, int]:
        """Host bytes a CPU engine will hold, by part, by arithmetic on the config (``estimate_weight_bytes``:
        nothing is built, so a corrupt config with a million layers is refused at once)."""
        # With fp32 activations (the exact path) a 4-/8-bit layer is dequantized once for the CPU GEMM; with
        # 16-bit ones it stays low-bit, its prepared form about the size of the run-time tensors it replaces.
        # MoE experts get a CPU copy either way (kernels/moe_cpu.py), which replaces and releases their W4 stacks:
        # counted by what it adds beyond them (0 for the int4 copy).
        cfg = runner.config
        weights, dense = model_cls.estimate_weight_bytes(checkpoint.hf_config, checkpoint.quant_config, runner.dtype)
        kv = cfg.kv_cache_memory_bytes or (0 if cfg.num_kv_blocks else CPU_DEFAULT_KV_CACHE_BYTES)
        dtype = str(runner.dtype).replace("torch.", "")
        return {f"weights ({dtype})": weights, "4-/8-bit layers dequantized and MoE experts prepared for the CPU": dense,
                "KV pool": int(kv)}

    def prepare_weights(self, runner: ModelRunner, progress: LoadProgress) -> None:
        if backend_name(torch.empty(0)) != "torch_cpu":
            # Not when another backend is forced (the Triton path on the interpreter, the reference oracle),
            # which reads the run-time tensors the preparation replaces.
            return
        # Each linear prepared once for the CPU GEMM (4-/8-bit ones stay low-bit with 16-bit activations).
        with progress.phase("preparing the weights for the CPU"):
            runner.model.pack_for_cpu()

    def kv_budget_bytes(self, runner: ModelRunner) -> tuple[int, str]:
        cfg = runner.config
        return (CPU_DEFAULT_KV_CACHE_BYTES if cfg.kv_cache_memory_bytes is None else int(cfg.kv_cache_memory_bytes)), ""

    def prepare_steps(self, runner: ModelRunner) -> None:
        assert runner.cpu_threads is not None  # prepare_process made it
        runner.cpu_threads.for_steps()

    def uses_graphs(self, runner: ModelRunner) -> bool:
        """On a bf16 CPU engine with the C ops, one KV-cache group and without ``enforce_eager``: fp32 engines
        multiply by torch's GEMM (and the C ops take no fp16), so there is nothing to replay
        (``cpu_graph.replay_unavailable`` says which condition fails)."""
        return self._unavailable(runner) is None

    @staticmethod
    def _unavailable(runner: ModelRunner) -> str | None:
        return replay_unavailable(runner.device, runner.config.enforce_eager, len(runner.kv_groups), runner.dtype,
                                  backend_name(torch.empty(0)))

    def same_numerics_rows(self, runner: ModelRunner, rows: int) -> int:
        """The 4-bit products compute each row alone in C below ``cpu_native.dense_rows`` rows and by a dense GEMM
        (or AMX tiles) from there: a step below it stays below it."""
        limit = cpu_native.dense_rows(runner.dtype) - 1
        return limit if rows <= limit else 1 << 30

    def graph_runner(self, runner: ModelRunner, progress: LoadProgress) -> CpuDecodeGraphRunner | None:
        """The recorded decode steps (``cpu_graph.py``): batches below the 4-bit products' dense path unless that
        path is a C op too (AMX). Sets ``runner.cpu_replay_off`` / ``cpu_replay_above`` (why not), records the
        step of one sequence (``CpuDecodeGraphRunner.probe``) and logs what is replayed, once."""
        runner.cpu_replay_off = self._unavailable(runner)
        graphs = None
        if runner.cpu_replay_off is None:
            rows = runner.max_decode_batch()
            if not cpu_native.dense_path_native(runner.dtype):
                rows = min(rows, cpu_native.dense_rows(runner.dtype) - 1)
            runner.cpu_replay_above = eager_above(rows, runner.max_decode_batch(), runner.dtype)
            graphs = CpuDecodeGraphRunner(runner.model, rows,
                                          runner.kv_spec.blocks_for(int(runner.config.max_model_len)),
                                          runner.kv_spec.block_size, runner.model.config.hidden_size, runner.dtype)
            graphs.probe()
        log_replay_plan(replay_report(graphs, runner.cpu_replay_off, runner.cpu_replay_above))
        return graphs


_PLATFORMS: dict[str, Platform] = {"cuda": CudaPlatform(), "cpu": CpuPlatform()}


def platform_for(device: torch.device) -> Platform:
    """The platform of ``device``'s type.

    Raises:
        ValueError: a device type without a platform (``config.resolve_device`` admits only cpu and cuda).
    """
    try:
        return _PLATFORMS[device.type]
    except KeyError:
        raise ValueError(f"no platform for device type {device.type!r}; lightinfer runs on cpu or cuda") from None
