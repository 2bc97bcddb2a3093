"""GPU memory accounting: how much of the budget is left for the KV pool.

Pure arithmetic on byte counts (measured by ``ModelRunner``), so that it can be unit-tested
without a GPU::

    budget = min(total * gpu_memory_utilization, max_vram)
           = weights + activation peak + CUDA graphs reserve + non-torch memory + KV pool

    KV pool = one pool per KV-cache group (full-attention layers; each sliding window's layers),
              split in proportion to what one max_model_len sequence needs in each (split_kv_pool)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

GIB = 2**30
MIB = 2**20
# The decode graphs' pool holds the activations of the largest captured batch. It is measured
# with an eager no-cache forward of that many tokens; a decode step's attention differs
# (partial outputs of the split decode kernel, allocator rounding inside the private pool),
# so a margin is added: 10% of the measurement plus a fixed 64 MiB.
GRAPH_RESERVE_FACTOR = 1.10
GRAPH_RESERVE_EXTRA = 64 * MIB


def graph_reserve_bytes(activation_peak: int) -> int:
    """Bytes to set aside for the CUDA graphs' memory pool, from the activation peak (bytes)
    of an eager forward of the largest captured batch size (``GRAPH_RESERVE_*`` say why)."""
    return int(max(activation_peak, 0) * GRAPH_RESERVE_FACTOR) + GRAPH_RESERVE_EXTRA


# GPU memory outside torch's allocator (CUDA context, cuBLAS and Triton workspaces and modules). The engine
# measures it at start-up (plan_kv_pool's non_torch_bytes); plans made before there is a GPU to measure
# (`lightinfer fit`, bench/serving/memory_table.py) assume this figure, typical of a desktop card with no display on it.
NON_TORCH_ESTIMATE = 512 * MIB


def embedding_stays_on_host(on_cuda: bool, tied: bool, setting: bool | None) -> bool:
    """Whether the engine keeps the input embedding in host memory (``EngineConfig.embedding_on_host``):
    only on CUDA, never when the table is tied to the LM head (the GPU reads it every step), and unless
    ``setting`` is False (None = yes)."""
    return on_cuda and not tied and setting is not False


def estimate_activation_bytes(hidden: int, mlp_width: int, vocab: int, num_tokens: int, max_num_seqs: int,
                              w4: bool, dtype_bytes: int = 2, expert_rows: int = 0) -> int:
    """Estimated peak bytes of the engine's profiling forward (``ModelRunner.profile_run``) over
    ``num_tokens`` tokens, from the shapes alone: what the engine measures at start-up, for plans made
    without a GPU.

    The peak is inside the MLP: residual, input and output ``[T, hidden]`` plus a spare one, the fused
    gate/up output ``[T, 2 x mlp_width]`` and its activation ``[T, mlp_width]``; a MoE layer's routed rows
    (``expert_rows`` per token, i.e. top-k: ``mlp_width`` is then top-k x the expert width) also hold their
    ``[T x top_k, hidden]`` outputs before the weighted sum. With 4-bit weights (``w4``), batches above 64
    rows dequantize each weight for cuBLAS one slab of rows at a time (``kernels/w4a16_gemm.py``: one slab
    plus that slab's output). Then the logits of one step's sampled rows (``max_num_seqs``: 16-bit out of
    the head, an fp32 copy, an fp32 softmax).

    Args:
        hidden, mlp_width, vocab: model widths (elements); num_tokens: tokens of the forward.
        dtype_bytes: bytes per activation element (2 on a GPU).
    Returns:
        bytes (int).
    """
    from lightinfer.kernels.w4a16_gemm import dequant_slab_rows

    h, i, t = int(hidden), int(mlp_width), int(num_tokens)
    act = t * (4 * h + 3 * i + int(expert_rows) * h) * dtype_bytes
    dequant = 0
    if w4 and t > 64 and not expert_rows:  # the largest slab: fused gate/up ([2i, h]) or down ([h, i])
        dequant = max(rows * k * dtype_bytes + t * rows * dtype_bytes
                      for n, k in ((2 * i, h), (h, i)) for rows in [dequant_slab_rows(n, k, dtype_bytes)])
    return act + dequant + min(t, max_num_seqs) * int(vocab) * (dtype_bytes + 4 + 4)


def decode_split_reserve_bytes(batch_sizes: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                               max_ctx: int, device: torch.device) -> int:
    """The split decode kernel's fp32 partials at the captured batch sizes (the largest of them: the graphs
    share one pool), part of the CUDA graphs' reserve. Graphs pass block tables as wide as ``max_model_len``
    (``max_ctx`` tokens, whole blocks), so these buffers grow with it; an eager profiling forward has none."""
    from lightinfer.kernels import decode_workspace_bytes

    return max(decode_workspace_bytes(bs, num_heads, num_kv_heads, head_dim, max_ctx, device) for bs in batch_sizes)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_weights_fit(budget: int, weight_bytes: int, budget_note: str = "") -> None:
    """Fail early, before any profiling, when the weights alone exceed ``budget`` (bytes).

    Raises:
        ValueError: ``weight_bytes > budget``, with both numbers and what to change.
    """
    if weight_bytes > budget:
        raise ValueError(
            f"the model's weights ({_gib(weight_bytes)}) cannot fit in the GPU memory budget of {_gib(budget)}"
            f"{f' ({budget_note})' if budget_note else ''}. Give the engine more memory (a larger max_vram or "
            f"gpu_memory_utilization) or use a smaller model, e.g. a 4-bit AWQ checkpoint made with "
            f"`lightinfer quantize`."
        )


def plan_kv_pool(
    budget: int,
    weight_bytes: int,
    activation_bytes: int,
    non_torch_bytes: int,
    graph_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    budget_note: str = "",
) -> tuple[int, str]:
    """Split ``budget`` (bytes) into the fixed costs and a KV pool of whole blocks.

    Args:
        budget: bytes the engine may use on the GPU.
        weight_bytes: bytes the loaded model holds (weights and buffers).
        activation_bytes: peak bytes of the eager forward at ``max_num_batched_tokens``.
        non_torch_bytes: GPU memory outside torch's allocator (CUDA context, cuBLAS and Triton
            workspaces and modules; other processes on the GPU count here too). Negative = 0.
        graph_bytes: the CUDA graphs' reserve (0 with ``enforce_eager``).
        bytes_per_block: KV bytes of one block over all layers.
        block_size: tokens per block.
        max_model_len: longest sequence, for the "sequences that fit" figure.
        budget_note: how ``budget`` was derived, shown in the report.
    Returns:
        ``(num_blocks, report)``: the KV pool in blocks (>= 0; whether one sequence fits is the
        caller's check) and a multi-line summary for the start-up log.
    Raises:
        ValueError: the weights, or the weights plus the other fixed costs, exceed the budget;
            the message gives every number and what to change.
    """
    non_torch_bytes = max(non_torch_bytes, 0)
    check_weights_fit(budget, weight_bytes, budget_note)
    fixed = weight_bytes + activation_bytes + non_torch_bytes + graph_bytes
    lines = [
        f"GPU memory plan: budget {_gib(budget)}{f' ({budget_note})' if budget_note else ''}",
        f"  weights          {_gib(weight_bytes)}",
        f"  activation peak  {_gib(activation_bytes)}",
        f"  CUDA graphs      {_gib(graph_bytes)}" + ("" if graph_bytes else " (enforce_eager: none)"),
        f"  non-torch        {_gib(non_torch_bytes)} (CUDA context, cuBLAS/Triton workspaces, other processes)",
    ]
    if fixed > budget:
        tips = ["lower max_num_batched_tokens (the activation peak grows with it)"]
        if graph_bytes:
            tips.append("lower max_num_seqs or set enforce_eager=True (no CUDA graphs reserve)")
        tips.append("give the engine more memory (a larger max_vram or gpu_memory_utilization)")
        tips.append("use a 4-bit AWQ model (`lightinfer quantize`)")
        raise ValueError(
            "the fixed GPU memory costs cannot fit in the budget, which leaves no room for the KV cache:\n"
            + "\n".join(lines) + f"\n  total fixed      {_gib(fixed)} > budget {_gib(budget)}\n"
            + "To fix: " + "; ".join(tips) + ". Then kv_cache_dtype='int8' and a lower max_model_len "
            "make the KV cache itself smaller."
        )
    num_blocks = (budget - fixed) // bytes_per_block if bytes_per_block > 0 else 0
    tokens = num_blocks * block_size
    lines.append(
        f"  KV pool          {_gib(num_blocks * bytes_per_block)} = {tokens} tokens ({num_blocks} blocks of "
        f"{block_size}), {tokens // max(max_model_len, 1)} full sequences of max_model_len={max_model_len}"
    )
    return int(num_blocks), "\n".join(lines)


@dataclass(frozen=True)
class KVGroupNeed:
    """What one KV-cache group needs, for :func:`split_kv_pool`.

    Attributes:
        name: for the report (``"full attention, 13 layers"``).
        bytes_per_block: KV bytes of one block over the group's layers.
        blocks_per_sequence: blocks one ``max_model_len`` sequence holds at most in the group (a sliding
            window's group: its window plus one step's chunk, ``block_manager.py``).
    """

    name: str
    bytes_per_block: int
    blocks_per_sequence: int


def sliding_window_blocks(window: int, chunk_tokens: int, block_size: int) -> int:
    """Most blocks one sequence holds in a sliding-window group: the window of the first token of a step plus
    that step's ``chunk_tokens`` (``block_manager.py``)."""
    return (window + chunk_tokens - 2) // block_size + 2


def split_kv_pool(kv_bytes: int, groups: list[KVGroupNeed]) -> list[int]:
    """Blocks per group out of ``kv_bytes``: in proportion to one ``max_model_len`` sequence's need in each, so
    that the pools hold the same number of such sequences (with one group: ``kv_bytes // bytes_per_block``).

    Sequences shorter than a window take as many blocks in its group as in a full one; a pool sized for long
    sequences then fills first with short ones: the price of a static split (block ids of one pool name
    memory of its own layers only, so the pools cannot lend each other blocks)."""
    if len(groups) == 1:
        return [max(0, kv_bytes // groups[0].bytes_per_block)]
    per_seq = sum(g.bytes_per_block * g.blocks_per_sequence for g in groups)
    return [max(0, kv_bytes * g.blocks_per_sequence // per_seq) for g in groups]


def describe_kv_groups(groups: list[KVGroupNeed], num_blocks: list[int], block_size: int) -> str:
    """One report line per KV-cache group: its blocks, tokens and bytes."""
    return "\n".join(f"  KV group {i} ({g.name}): {n} blocks = {n * block_size} tokens, "
                     f"{_gib(n * g.bytes_per_block)}; a max_model_len sequence holds at most {g.blocks_per_sequence}"
                     for i, (g, n) in enumerate(zip(groups, num_blocks)))


def available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (what can be allocated without swapping);
    None where there is no such file (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts KiB
    except OSError:
        return None
    return None


def check_host_memory(parts: dict[str, int], available: int | None) -> None:
    """Refuse to build a CPU model that cannot fit in host memory (it would be OOM-killed or
    swap for minutes, with no useful message).

    Args:
        parts: bytes by what needs them, e.g. ``{"weights (float32)": ..., "KV pool": ...}``.
        available: bytes available (``available_host_bytes()``); None skips the check.
    Raises:
        ValueError: the parts add up to more than ``available``; every figure is in the message.
    """
    need = sum(parts.values())
    if available is None or need <= available:
        return
    detail = ", ".join(f"{name} {_gib(n)}" for name, n in parts.items() if n)
    raise ValueError(
        f"on the CPU this model needs about {_gib(need)} of memory ({detail}) but only {_gib(available)} is "
        f"available. Run it on a GPU (device='cuda'), or use a smaller model; the configs in bench/configs/ are "
        f"meant for GPU benchmarks."
    )


def module_bytes(module: nn.Module, exclude: tuple[object, ...] = ()) -> int:
    """Bytes of ``module``'s parameters and buffers (non-persistent ones too), each tensor once
    (a tied head counts once); ``exclude``: tensors to leave out. Works on a meta-device model,
    where nothing is allocated (tensors are told apart by identity, not by address)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    for t in exclude:
        tensors.pop(id(t), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


# What a GPU engine needs besides weights and KV: CUDA context (~0.4 GiB), the activation peak of a
# 2048-token step and the CUDA-graph pool of a ~7B model, cuBLAS/Triton workspaces. An assumption for
# advice from arithmetic alone; the real start-up plan (plan_kv_pool) measures each of them.
FIT_RESERVE = 1 * GIB


def cpu_experts_needed(total_weight_bytes: int, expert_bytes_per_layer: list[int], kv_bytes: int, budget: int,
                       reserve: int = FIT_RESERVE) -> int | None:
    """Fewest MoE layers (taken in order) whose experts must move to host memory for the rest of the weights,
    ``reserve`` and ``kv_bytes`` of KV cache to fit ``budget`` (bytes); 0 if everything fits, None if even all
    experts on the host leave too much."""
    need = total_weight_bytes + reserve + kv_bytes
    for n, layer_bytes in enumerate([0, *expert_bytes_per_layer]):
        need -= layer_bytes
        if need <= budget:
            return n
    return None


def moe_fit_advice(total_weight_bytes: int, expert_bytes_per_layer: list[int], kv_bytes_per_token: int,
                   max_model_len: int, budget: int, budget_note: str, reserve: int = FIT_RESERVE) -> str:
    """One sentence: how a MoE model fits ``budget`` bytes of GPU memory, all on the GPU or with ``--cpu-experts N``
    (the smallest N leaving room for one ``max_model_len`` sequence's KV cache, ``kv_bytes_per_token`` each).

    Args:
        total_weight_bytes: every weight (experts included); expert_bytes_per_layer: each MoE layer's experts,
            in layer order; budget_note: what the budget is, e.g. "a 12 GB card".
    """
    where = f"on {budget_note} ({_gib(budget)})"
    kv = kv_bytes_per_token * max_model_len
    n = cpu_experts_needed(total_weight_bytes, expert_bytes_per_layer, kv, budget, reserve)
    if n is None:
        rest = total_weight_bytes - sum(expert_bytes_per_layer)
        return (f"{where}: does not fit even with every expert in host memory (the other weights take "
                f"{_gib(rest)}, plus ~{_gib(reserve)} of runtime and {_gib(kv)} of KV for max_model_len={max_model_len})")
    gpu = total_weight_bytes - sum(expert_bytes_per_layer[:n])
    tokens = max(0, budget - gpu - reserve) // max(kv_bytes_per_token, 1)
    if n == 0:
        return (f"{where}: fits on the GPU (weights {_gib(gpu)}, ~{_gib(reserve)} runtime, KV for {tokens} tokens)")
    return (f"{where}: the weights ({_gib(total_weight_bytes)}) do not fit; --cpu-experts {n} keeps the experts of "
            f"the first {n} of {len(expert_bytes_per_layer)} MoE layers ({_gib(total_weight_bytes - gpu)}) in host "
            f"memory, leaving {_gib(gpu)} of weights on the GPU, ~{_gib(reserve)} of runtime and KV for {tokens} "
            f"tokens (at least one sequence of max_model_len={max_model_len})")
