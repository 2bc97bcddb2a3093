"""The chat UI's side panels: the model (what was loaded, how much memory it holds and why) and the engine's
live counters."""

from __future__ import annotations

from typing import Any

from lightinfer.engine.async_engine import AsyncLLMEngine

MIB = 2**20


def weights_note(info: dict[str, Any]) -> str:
    """Why the weights in memory differ from the checkpoint files (the panel's footnote), or ""."""
    held, files, dtype = info.get("weight_bytes") or 0, info.get("checkpoint_bytes") or 0, info.get("dtype")
    parts = []
    if files and held != files:
        why = []
        if dtype == "float32":
            why.append("unquantized tensors (embedding, norms) are float32, where files usually hold 16 bits")
        if info.get("quantization"):
            why.append(f"each quantized layer keeps its scales and zeros in {dtype}, one per group and output channel")
        parts.append(f"the checkpoint files are {files / MIB:,.1f} MiB" + (f"; in memory {' and '.join(why)}"
                                                                           if why else ""))
    experts = info.get("cpu_expert_bytes") or 0
    cpu_copy = (info.get("cpu_dense_bytes") or 0) - experts  # the linears' part; the experts' said apart
    if cpu_copy:
        what = ("the quantized layers kept dequantized for the fp32 GEMM" if dtype == "float32" else
                "a quantized embedding table's rows kept in 16 bits for the lookup (the layers stay 4-/8-bit)")
        parts.append(f"of it, {cpu_copy / MIB:,.1f} MiB are {what}")
    if experts:
        # cpu_expert_bytes: what the experts' CPU copies add beyond the 4-bit stacks they replace (0 for int4)
        parts.append(f"{experts / MIB:,.1f} MiB are what the MoE experts' copies prepared for the CPU GEMMs add "
                     f"(beyond the 4-bit stacks they replace)")
    return "; ".join(parts)


def model_panel(info: dict[str, Any]) -> str:
    """Markdown table of the model: name, quantization, KV cache, memory (with why it differs from the
    files), context."""
    q = info.get("quantization")
    quant = f"{q['method'].upper()} W{q['bits']}A16, group size {q['group_size']}" if q and q.get("bits") else (
        str(q["method"]).upper() if q else "none")
    weights = info.get("weight_bytes") or 0
    note = weights_note(info)
    lines = [
        f"| Model | `{info.get('model')}` |", "|---|---|",
        f"| Quantization | {quant} |",
        f"| KV cache | {info.get('kv_cache_dtype')} |",
        f"| Weights | {weights / MIB:,.1f} MiB in memory{' ¹' if note else ''} |",
        (f"| KV pool | {info.get('kv_pool_tokens', 0):,} tokens ({info.get('num_kv_blocks')} blocks of "
         f"{info.get('block_size')}) |"),
        f"| Max context | {info.get('max_model_len'):,} tokens |",
        f"| Device | {info.get('device')} · {info.get('dtype')} |",
    ]
    if note:
        lines += ["", f"¹ {note[0].upper()}{note[1:]}."]
    return "\n".join(lines)


def engine_panel(engine: AsyncLLMEngine) -> str:
    """One line of live engine stats."""
    s = engine.get_stats()
    return (f"running **{s.num_running}** · waiting **{s.num_waiting}** · batch **{s.last_batch_size}** "
            f"(max {s.max_batch_size}) · KV used **{100 * s.kv_cache_usage:.0f}%** "
            f"({s.num_free_blocks}/{s.num_total_blocks} blocks free) · preemptions {s.num_preemptions}"
            + _spec_line(s.spec_decode))


def _spec_line(spec: dict | None) -> str:
    """The engine line's speculative decoding part: drafts accepted so far and the mean tokens a verify gave."""
    if spec is None:
        return ""
    if not spec["num_draft_tokens"]:
        return f" · speculative ({spec['method']}): no drafts yet"
    return (f" · speculative ({spec['method']}): **{100 * spec['acceptance_rate']:.0f}%** of "
            f"{spec['num_draft_tokens']} drafts accepted, {spec['mean_accepted_length']:.2f} tokens per verify")
