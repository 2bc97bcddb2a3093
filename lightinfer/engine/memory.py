"""GPU memory accounting: how much of the budget is left for the KV pool.

Pure arithmetic on byte counts (measured by ``ModelRunner``), so that it can be unit-tested
without a GPU::

    budget = min(total * gpu_memory_utilization, max_vram)
           = weights + activation peak + CUDA graphs reserve + non-torch memory + KV pool
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

