"""How many 2,048-token sequences fit in 8/12/16/24 GiB: W4 + INT8 KV, W4 + fp16 KV, fp16 + fp16 KV.

Two modes, one table format (``bench/results/memory_table[_measured].json`` + PNG):

* computed (default, any machine): weights are summed exactly from the model built on the meta
  device (4-bit layers, fp16 head and norms, the rotary table; an untied input embedding is in
  host memory, the engine's default on CUDA: ``EngineConfig.embedding_on_host``); the KV bytes per token
  come from ``KVCacheSpec`` (INT8 includes the fp16 scale and zero per token and head); the
  activation peak of the profiling forward at ``max_num_batched_tokens`` is estimated from the
  shapes (see :func:`activation_bytes`); CUDA context and library workspaces not owned by
  torch's allocator are an assumed ``--non-torch-gib`` (0.5 GiB by default, a typical figure
  on a desktop card without a display attached). KV pool = budget - all of these.
* ``--measure`` (a GPU): the engine itself starts with ``max_vram=<budget>`` and dummy weights;
  the table records the KV pool it sized (so the figures include everything the engine counts),
  then runs a few 2,048-token requests and records the GPU memory really used against the budget.

The computed mode reads the engine's memory model (``lightinfer.engine.memory``, what ``lightinfer fit`` uses:
the seam it measures); the measured one runs the engine through ``LLM`` and ``model_info()``.

    python -m bench.serving.memory_table [--measure] [--models llama-3-8b llama-2-7b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.common.results import CONFIGS, RESULTS, write_json

BUDGETS_GIB = (8, 12, 16, 24)
DEFAULT_MODELS = ["llama-3-8b", "llama-2-7b"]
MAX_NUM_SEQS = 64  # the engine's default
VARIANTS = {"W4 + INT8 KV": ("awq", "int8"), "W4 + fp16 KV": ("awq", "auto"), "fp16 + fp16 KV": (None, "auto")}
SEQ_LEN = 2048
# The engine's "does not fit" messages (engine/memory.py, ModelRunner): a 0 cell, not a failure.
FIT_ERRORS = ("cannot fit in the GPU memory budget", "fixed GPU memory costs cannot fit", "the KV cache has room")
GIB = 2**30


def _model_path(model: str) -> str:
    """A ``bench/configs/`` name or a model folder.

    Raises:
        FileNotFoundError: neither, with the names that exist.
    """
    if (CONFIGS / model).is_dir():
        return str(CONFIGS / model)
    if Path(model).is_dir():
        return model
    names = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())
    raise FileNotFoundError(f"{model!r} is neither a config in bench/configs/ ({', '.join(names)}) nor a folder")


def _checkpoint(model: str) -> object:
    from lightinfer.loader import Checkpoint

    return Checkpoint(_model_path(model), read_weights=False)


def weight_bytes(hf_config: object, quantization: str | None, dtype: torch.dtype = torch.float16,
                 embedding_on_host: bool = True) -> int:
    """GPU bytes of every tensor the engine's model holds (parameters and buffers, rotary table
    included), built on the meta device: nothing is allocated. As the engine does by default,
    an untied input embedding stays in host memory and is not counted."""
    from lightinfer.dummy_weights import dummy_awq_config
    from lightinfer.engine.memory import module_bytes
    from lightinfer.models.registry import get_model_class

    qc = dummy_awq_config(hf_config) if quantization == "awq" else None
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config, qc, dtype)
    host = (model.embed_tokens.weight,) if embedding_on_host and not model.tie_word_embeddings else ()
    return module_bytes(model, exclude=host)


def kv_bytes_per_token(hf_config: object, kv_cache_dtype: str, block_size: int = 16) -> int:
    """KV cache bytes per token over all layers (``KVCacheSpec.bytes_per_token``)."""
    from lightinfer.kernels import KVCacheSpec
    from lightinfer.models.llama import head_dim_of

    dtype = torch.int8 if kv_cache_dtype == "int8" else torch.float16
    return KVCacheSpec(hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim_of(hf_config),
                       block_size, dtype).bytes_per_token


def activation_bytes(hf_config: object, quantization: str | None, num_tokens: int = 2048) -> int:
    """Estimated peak of the profiling forward over ``num_tokens`` tokens (fp16): the engine's own estimate
    (``lightinfer.engine.memory.estimate_activation_bytes``, also what ``lightinfer fit`` uses; its docstring
    says what it counts)."""
    from lightinfer.engine.memory import estimate_activation_bytes

    return estimate_activation_bytes(hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size,
                                     num_tokens, MAX_NUM_SEQS, quantization == "awq")


def graph_reserve_bytes(hf_config: object, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """CUDA graphs' pool: the engine's reserve (``engine.memory.graph_reserve_bytes``: + 10% + 64 MiB) of a
    decode forward's estimated activations at ``max_num_seqs`` rows."""
    from lightinfer.engine.memory import graph_reserve_bytes as reserve

    return reserve(activation_bytes(hf_config, None, max_num_seqs))


def computed_row(model: str, variant: str, budget_gib: int, non_torch_gib: float) -> dict:
    """One table cell from the shapes alone (see the module docstring for what is assumed)."""
    hf = _checkpoint(model).hf_config
    quant, kv_dtype = VARIANTS[variant]
    w = weight_bytes(hf, quant)
    act = activation_bytes(hf, quant)
    kv_pool = budget_gib * GIB - w - act - graph_reserve_bytes(hf) - int(non_torch_gib * GIB)
    per_tok = kv_bytes_per_token(hf, kv_dtype)
    tokens = max(0, kv_pool) // (per_tok * 16) * 16  # whole blocks of 16 tokens
    return {"model": model, "variant": variant, "budget_gib": budget_gib, "weights_gib": w / GIB,
            "activations_gib": act / GIB, "kv_bytes_per_token": per_tok, "kv_pool_tokens": int(tokens),
            "sequences_2048": int(tokens // SEQ_LEN)}


def measured_row(model: str, variant: str, budget_gib: int) -> dict:
    """One table cell from the engine itself on a GPU: dummy weights, ``max_vram=budget``."""
    import gc

    from lightinfer import LLM

    quant, kv_dtype = VARIANTS[variant]
    row = {"model": model, "variant": variant, "budget_gib": budget_gib}
    torch.cuda.reset_peak_memory_stats()
    try:
        llm = LLM(_model_path(model), load_format="dummy", quantization=quant, kv_cache_dtype=kv_dtype,
                  dtype="float16", max_model_len=SEQ_LEN, max_vram=f"{budget_gib}GiB", gpu_memory_utilization=1.0)
    except ValueError as e:
        if not any(m in str(e) for m in FIT_ERRORS):
            raise  # a bad config, not a budget too small
        # Does not fit: the cell is 0 and the engine's own message says why.
        return {**row, "kv_pool_tokens": 0, "sequences_2048": 0, "error": str(e).splitlines()[0]}
    info = llm.llm_engine.model_info()
    tokens = info["kv_pool_tokens"]
    # The plan is a promise: run a full-budget prefill step and decodes, then check what the
    # process really holds on the GPU (torch's reserved peak + memory outside torch) against it.
    from lightinfer import SamplingParams

    prompts = [[7] * (SEQ_LEN - 64)] * 4
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    used = total - free  # everything this process (and any other) holds on the GPU now
    peak = torch.cuda.max_memory_reserved() + (used - torch.cuda.memory_reserved())
    row.update(weights_gib=info["weight_bytes"] / GIB,
               kv_bytes_per_token=kv_bytes_per_token(_checkpoint(model).hf_config, kv_dtype),
               kv_pool_tokens=int(tokens), sequences_2048=int(tokens // SEQ_LEN), peak_used_gib=peak / GIB,
               within_budget=bool(peak <= budget_gib * GIB))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars per model: sequences of 2,048 tokens per budget and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for k, variant in enumerate(VARIANTS):
            vals = [next(r["sequences_2048"] for r in rows if r["model"] == model and r["variant"] == variant
                         and r["budget_gib"] == b) for b in BUDGETS_GIB]
            xs = [j + (k - 1) * 0.27 for j in range(len(BUDGETS_GIB))]
            ax.bar_label(ax.bar(xs, vals, width=0.27, label=variant), fontsize=7)
        ax.set_xticks(range(len(BUDGETS_GIB)), [f"{b} GiB" for b in BUDGETS_GIB])
        ax.set_title(model)
        ax.set_ylabel("concurrent 2,048-token sequences")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: list[dict]) -> str:
    """The README table: one line per model and variant, one column per budget."""
    lines = ["| model | weights + KV | " + " | ".join(f"{b} GiB" for b in BUDGETS_GIB) + " |",
             "|---|---|" + "---|" * len(BUDGETS_GIB)]
    for model in sorted({r["model"] for r in rows}, reverse=True):
        for variant in VARIANTS:
            cells = [next(r for r in rows if r["model"] == model and r["variant"] == variant and r["budget_gib"] == b)
                     for b in BUDGETS_GIB]
            lines.append(f"| {model} | {variant} | " + " | ".join(
                f"{c['sequences_2048']} ({c['kv_pool_tokens'] / 1000:.1f}k tok)" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--measure", action="store_true", help="start the engine on the GPU for every cell")
    from lightinfer.engine.memory import NON_TORCH_ESTIMATE

    ap.add_argument("--non-torch-gib", type=float, default=NON_TORCH_ESTIMATE / GIB,
                    help="computed mode: CUDA context etc. (engine.memory.NON_TORCH_ESTIMATE, as in lightinfer fit)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.measure and not torch.cuda.is_available():
        raise ValueError("--measure starts the engine on a GPU and this machine has none; without --measure "
                         "the table is computed from the shapes")
    for m in args.models:
        _model_path(m)  # a misspelled name fails before any work
    rows = [measured_row(m, v, b) if args.measure else computed_row(m, v, b, args.non_torch_gib)
            for m in args.models for v in VARIANTS for b in BUDGETS_GIB]
    name = "memory_table_measured" if args.measure else "memory_table"
    if args.models != DEFAULT_MODELS:  # a partial table (e.g. one model per device call)
        name += "_" + "_".join(args.models)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mode = "measured: the engine on the GPU, max_vram=budget" if args.measure else (
        f"computed from the shapes; {args.non_torch_gib} GiB assumed for the CUDA context")
    write_json(out / f"{name}.json", {"mode": mode, "seq_len": SEQ_LEN, "rows": rows})
    print(markdown(rows))
    try:
        plot(rows, out / f"{name}.png", f"concurrent {SEQ_LEN}-token sequences per budget ({mode})")
    except ImportError:
        print("matplotlib missing: no PNG written")
    return rows


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
