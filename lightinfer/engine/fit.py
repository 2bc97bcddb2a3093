"""``lightinfer fit``: will a model fit a card, and how many sequences, before anything is downloaded or loaded.

For each VRAM budget and three variants (W4 + INT8 KV, W4 + fp16 KV, the checkpoint as it is) it runs the
engine's own CUDA memory plan (:func:`~lightinfer.engine.memory.plan_kv_pool`) on figures computed from the
config and tensor headers (``fit_weights.py``), with the engine's rules: budget = VRAM x
``gpu_memory_utilization``; an untied input embedding stays in host memory; the CUDA graphs' reserve
(:func:`~lightinfer.engine.memory.graph_reserve_bytes` of the largest captured batch, plus the split decode's
partials); ``max_model_len`` resolved as the engine resolves it (the model's context or sliding window, at most
8192); MoE models that do not fit get the smallest ``--cpu-experts N``
(:func:`~lightinfer.engine.memory.cpu_experts_needed`). Where the engine measures (the activation peak, the
memory outside torch), ``fit`` estimates (:func:`~lightinfer.engine.memory.estimate_activation_bytes`,
:data:`~lightinfer.engine.memory.NON_TORCH_ESTIMATE`): the figures are computed, not measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from lightinfer.config import EngineConfig, parse_bytes
from lightinfer.engine.cuda_graph import graph_batch_sizes
from lightinfer.engine.fit_weights import WeightPlan, checkpoint_plan, w4_plan
from lightinfer.engine.kv_groups import kv_groups_for_windows
from lightinfer.engine.llm_engine import resolve_max_model_len
from lightinfer.engine.memory import (
    GIB,
    NON_TORCH_ESTIMATE,
    cpu_experts_needed,
    decode_split_reserve_bytes,
    embedding_stays_on_host,
    estimate_activation_bytes,
    graph_reserve_bytes,
    plan_kv_pool,
    split_kv_pool,
)
from lightinfer.kernels import KVCacheSpec
from lightinfer.layers.attention import sliding_window_of
from lightinfer.loader import Checkpoint
from lightinfer.models.llama import head_dim_of
from lightinfer.models.registry import architecture_of, get_model_class

DEFAULT_VRAM = ("8GiB", "12GiB", "24GiB")
KV_DTYPES = {"auto": None, "fp16": torch.float16, "int8": torch.int8}
_ENGINE = {f.name: f.default for f in fields(EngineConfig)}  # the engine's defaults, so fit plans as it runs
_DTYPES = {"auto": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class FitRow:
    """One budget x variant. Bytes are ints; ``kv_tokens`` and ``sequences`` count tokens and full-length
    sequences of ``max_model_len`` in the KV pool (0 when it does not fit).

    Attributes:
        vram_bytes: the card's memory; budget_bytes: what the engine may use (x gpu_memory_utilization).
        variant: "W4 + INT8 KV", "W4 + fp16 KV" or "as is + <kv> KV"; weights: what the weights are.
        weight_bytes: weights on the GPU; host_bytes: weights in host memory (embedding, --cpu-experts: the
            moved experts, plus what the CPU copy the engine makes of them for its CPU GEMMs adds beyond the W4
            stacks it releases: 0 for W4 experts with 16-bit activations).
        activation_bytes, graph_bytes, non_torch_bytes: the other fixed costs (estimates).
        kv_cache_dtype: "int8", "fp16" or "bf16"; kv_bytes_per_token: over all layers.
        fits: one max_model_len sequence fits with ``flags``; flags: engine flags it needs ("" for none).
        note: why it does not fit, or what the flags do.
    """

    vram_bytes: int
    budget_bytes: int
    variant: str
    weights: str
    weight_bytes: int
    host_bytes: int
    activation_bytes: int
    graph_bytes: int
    non_torch_bytes: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_tokens: int
    sequences: int
    fits: bool
    flags: str = ""
    note: str = ""

    @property
    def reserved_bytes(self) -> int:
        """Activation peak + CUDA graphs + memory outside torch."""
        return self.activation_bytes + self.graph_bytes + self.non_torch_bytes


@dataclass
class FitReport:
    """What ``fit`` found: the model, the settings planned with, and one :class:`FitRow` per budget x variant."""

    model: str
    architecture: str
    max_model_len: int
    gpu_memory_utilization: float
    file_bytes: int | None
    rows: list[FitRow]

    def to_dict(self) -> dict:
        """JSON-ready: every field, each row with its ``reserved_bytes``."""
        out = asdict(self)
        for d, row in zip(out["rows"], self.rows):
            d["reserved_bytes"] = row.reserved_bytes
        return out

    def table(self) -> str:
        """The report as text: a header line and one line per row (GiB, tokens, sequences)."""
        size = f", {self.file_bytes / GIB:.2f} GiB of tensors on disk" if self.file_bytes else ""
        head = (f"{self.model} ({self.architecture}{size}): max_model_len {self.max_model_len}, "
                f"gpu_memory_utilization {self.gpu_memory_utilization:g}; computed from the config and tensor "
                f"headers, not measured")
        cols = ["VRAM", "variant", "weights", "GPU weights", "host", "reserved", "KV tokens",
                f"seqs x {self.max_model_len}", "fits"]
        lines = [[f"{r.vram_bytes / GIB:g} GiB", r.variant, r.weights, f"{r.weight_bytes / GIB:.2f} GiB",
                  f"{r.host_bytes / GIB:.2f} GiB", f"{r.reserved_bytes / GIB:.2f} GiB", f"{r.kv_tokens:,}",
                  str(r.sequences), ("yes" if r.fits else "no") + (f", {r.flags}" if r.flags else "")]
                 for r in self.rows]
        widths = [max(len(c), *(len(v[i]) for v in lines)) for i, c in enumerate(cols)]
        fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
        notes = [f"  {r.vram_bytes / GIB:g} GiB, {r.variant}: {r.note}" for r in self.rows if r.note]
        return "\n".join([head, fmt(cols), *map(fmt, lines), *(["notes:", *notes] if notes else [])])


def _kv_spec(hf_config: object, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    return KVCacheSpec(int(hf_config.num_hidden_layers), int(hf_config.num_key_value_heads), head_dim_of(hf_config),
                       block_size, dtype)


def _mlp_width(hf_config: object) -> tuple[int, int]:
    """(MLP width per token, routed rows per token) for the activation estimate: a dense layer's
    ``intermediate_size``, or a MoE layer's top-k x expert width (+ a shared expert), whichever is larger."""
    cls = get_model_class(hf_config)
    sparse = cls.moe_layer_ids(hf_config)
    dense = int(hf_config.intermediate_size) if len(sparse) < int(hf_config.num_hidden_layers) else 0
    if not sparse:
        return dense, 0
    spec = cls.moe_spec  # type: ignore[attr-defined]
    top_k = int(hf_config.num_experts_per_tok)
    moe = top_k * int(getattr(hf_config, spec.intermediate)) + spec.shared_size(hf_config)
    return max(dense, moe), top_k if moe >= dense else 0


def _plan(weights: WeightPlan, kv_dtype: torch.dtype, vram: int, ctx: dict) -> FitRow:
    """One row: the engine's plan for ``weights`` and a ``kv_dtype`` cache on a ``vram``-byte card."""
    hf, mml, util = ctx["hf_config"], ctx["max_model_len"], ctx["gpu_memory_utilization"]
    spec = _kv_spec(hf, kv_dtype, ctx["block_size"])
    budget = int(vram * util)
    host = weights.host_bytes(embedding_stays_on_host(True, weights.tied, None))
    gpu = weights.total - host
    width, routed = _mlp_width(hf)
    estimate = lambda tokens: estimate_activation_bytes(
        hf.hidden_size, width, hf.vocab_size, tokens, ctx["max_num_seqs"], weights.w4, ctx["elem"], routed)
    activation = estimate(ctx["max_num_batched_tokens"])
    sizes = graph_batch_sizes(min(ctx["max_num_seqs"], ctx["max_num_batched_tokens"]))
    # A CPU device stands for the card: the split plan of a large decode batch does not depend on the SM count.
    graphs = graph_reserve_bytes(estimate(sizes[-1])) + decode_split_reserve_bytes(
        sizes, int(hf.num_attention_heads), spec.num_kv_heads, spec.head_dim, spec.blocks_for(mml) * spec.block_size,
        torch.device("cpu"))
    non_torch = ctx["non_torch_bytes"]
    kv_name = "int8" if spec.is_int8 else str(kv_dtype).replace("torch.float16", "fp16").replace("torch.", "")
    row = FitRow(vram, budget, "", weights.label, gpu, host, activation, graphs, non_torch, kv_name,
                 spec.bytes_per_token, 0, 0, False)

    def pool(weight_bytes: int, graph_bytes: int) -> tuple[int, str]:
        try:
            blocks, _ = plan_kv_pool(budget, weight_bytes, activation, non_torch, graph_bytes, spec.bytes_per_block,
                                     spec.block_size, mml)
        except ValueError as e:  # the engine's own "does not fit" message
            return 0, str(e).splitlines()[0].split(". ")[0]
        return blocks, ""

    # Sliding-window layers keep only their window of each sequence (engine/kv_groups.py): the engine splits the
    # pool between the groups, a full-length sequence needing what it holds in each.
    needs = [g.need(mml, ctx["max_num_batched_tokens"]) for g in kv_groups_for_windows(
        [sliding_window_of(hf, i) for i in range(int(hf.num_hidden_layers))], spec.num_kv_heads, spec.head_dim,
        mml, spec.block_size, kv_dtype)]
    per_sequence = sum(n.bytes_per_block * n.blocks_per_sequence for n in needs)
    blocks, row.note = pool(gpu, graphs)
    need = -(-per_sequence // spec.bytes_per_block)  # one sequence, in blocks of every layer
    if blocks >= need:
        row.fits = True
    elif weights.expert_bytes:  # MoE: move the first N layers' experts to host memory (no CUDA graphs then)
        n = cpu_experts_needed(gpu, weights.expert_bytes, need * spec.bytes_per_block, budget, activation + non_torch)
        if n is None:
            row.note = (f"does not fit even with every expert in host memory (--cpu-experts "
                        f"{len(weights.expert_bytes)})")
        else:
            moved = sum(weights.expert_bytes[:n])
            # what their CPU copy (kernels/moe_cpu.py) adds beyond the W4 stacks it replaces (0 for int4)
            copies = sum(weights.expert_copy_bytes[:n])
            blocks, _ = pool(gpu - moved, 0)
            row.weight_bytes, row.host_bytes, row.graph_bytes = gpu - moved, host + moved + copies, 0
            row.fits, row.flags = blocks >= need, (f"--cpu-experts {n}" if n else "--enforce-eager")
            copy_note = f" with what their CPU GEMMs' copy adds ({copies / GIB:.2f} GiB)" if copies else ""
            row.note = (f"the experts of the first {n} of {len(weights.expert_bytes)} MoE layers in host memory"
                        f"{copy_note}, computed on the CPU (no CUDA graphs)" if n
                        else "fits without the CUDA graphs' reserve")
    else:
        eager, _ = pool(gpu, 0)
        if eager >= need:
            blocks, row.fits, row.flags = eager, True, "--enforce-eager"
            row.note = "fits only without the CUDA graphs' reserve (decode runs eagerly, slower)"
        elif not row.note:
            row.note = (f"the KV pool holds {blocks * spec.block_size} tokens, less than one sequence of "
                        f"max_model_len={mml}; lower --max-model-len")
    kv_bytes = blocks * spec.bytes_per_block
    row.kv_tokens = split_kv_pool(kv_bytes, needs)[0] * spec.block_size if row.fits else 0  # group 0's, as the engine
    row.sequences = kv_bytes // per_sequence if row.fits else 0
    return row


def _parse_vram(vram: object) -> list[int]:
    items = [v.strip() for v in vram.split(",")] if isinstance(vram, str) else list(vram)
    out = []
    for v in items:
        try:
            n = parse_bytes(v if isinstance(v, int) else str(v))
        except ValueError:
            raise ValueError(f"--vram: cannot read a memory size from {v!r}; write sizes like 8GiB, 12GB, 12G or "
                             f"12000MiB, separated by commas") from None
        if not n or n <= 0:
            raise ValueError(f"--vram: {v!r} is not a positive memory size")
        out.append(int(n))
    if not out:
        raise ValueError("--vram: give at least one memory size, e.g. 8GiB,12GiB")
    return out


def fit(model: str, vram: object = DEFAULT_VRAM, max_model_len: int | None = None, kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = _ENGINE["gpu_memory_utilization"], dtype: str = "auto",
        max_num_seqs: int = _ENGINE["max_num_seqs"], max_num_batched_tokens: int = _ENGINE["max_num_batched_tokens"],
        non_torch_bytes: int = NON_TORCH_ESTIMATE) -> FitReport:
    """Will ``model`` fit these cards? Reads the config and tensor headers only (seconds for any size).

    Args:
        model: a Hugging Face folder (config.json + *.safetensors, or config.json alone), a ``.gguf`` file, or
            ``smollm2-135m-instruct``.
        vram: card sizes: "8GiB,12GiB" or a list of sizes (str or bytes); "12GB" and "12G" mean GiB, as
            everywhere in lightinfer.
        max_model_len: tokens per sequence (None: as the engine resolves it).
        kv_cache_dtype: the KV cache of the "as is" rows: auto (the model dtype, 16-bit on a GPU), fp16 or int8.
        gpu_memory_utilization: the share of each card the engine plans with.
        dtype: the engine's GPU dtype: auto (16-bit), float16, bfloat16 or float32 (sizes only).
        max_num_seqs, max_num_batched_tokens: the engine's step limits (they set the activation peak and the
            CUDA graphs' reserve).
        non_torch_bytes: CUDA context and library workspaces (the engine measures them; here an estimate).
    Returns:
        :class:`FitReport`, rows ordered by budget, then W4 + INT8 KV, W4 + fp16 KV, as is.
    Raises:
        FileNotFoundError: no such model. ValueError: bad settings, a folder without config.json, an
            architecture lightinfer does not run (the message lists those it does), an unreadable header.
    """
    budgets = _parse_vram(vram)
    if max_model_len is not None and int(max_model_len) <= 0:
        raise ValueError(f"--max-model-len must be a positive number of tokens, got {max_model_len}")
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_cache_dtype!r}")
    if not 0.0 < float(gpu_memory_utilization) <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
    checkpoint = Checkpoint(model, read_weights=False)
    hf = checkpoint.hf_config
    get_model_class(hf)  # an unknown architecture: one line listing the supported ones
    mml = resolve_max_model_len(hf, None if max_model_len is None else int(max_model_len))
    torch_dtype = _DTYPES[dtype]
    ctx = {"hf_config": hf, "max_model_len": mml, "gpu_memory_utilization": float(gpu_memory_utilization),
           "block_size": _ENGINE["block_size"], "max_num_seqs": int(max_num_seqs),
           "max_num_batched_tokens": int(max_num_batched_tokens), "non_torch_bytes": int(non_torch_bytes),
           "elem": torch.empty(0, dtype=torch_dtype).element_size()}
    as_is = checkpoint_plan(checkpoint, torch_dtype)
    try:
        w4: WeightPlan | None = w4_plan(hf, torch_dtype)
        w4_error = ""
    except ValueError as e:
        w4, w4_error = None, str(e).splitlines()[0]
    as_is_kv = KV_DTYPES[kv_cache_dtype] or torch_dtype
    rows = []
    for vram_bytes in budgets:
        for name, plan, kv in (("W4 + INT8 KV", w4, torch.int8), ("W4 + fp16 KV", w4, torch.float16),
                               ("as is", as_is, as_is_kv)):
            if plan is None:
                rows.append(FitRow(vram_bytes, int(vram_bytes * ctx["gpu_memory_utilization"]), name, "W4", 0, 0, 0,
                                   0, 0, "int8" if kv == torch.int8 else "fp16", 0, 0, 0, False, note=w4_error))
                continue
            row = _plan(plan, kv, vram_bytes, ctx)
            row.variant = name if plan is w4 else f"as is + {row.kv_cache_dtype} KV"
            rows.append(row)
    return FitReport(checkpoint.name, architecture_of(hf), mml, float(gpu_memory_utilization), as_is.file_bytes, rows)
