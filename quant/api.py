"""``quantize(src, out, QuantConfig)``: a Hugging Face / GGUF model -> a compressed-tensors (default) or AutoAWQ
"gemm" checkpoint.

The driver: validate everything (output folder, architecture, group size, calibration text)
before any heavy work, then walk the decoder layers one at a time (only that layer's weights
on the compute device, streamed from the checkpoint), and write the result atomically
(``quant/export.py``). Exposed as ``lightinfer.quantize``.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from lightinfer.config import resolve_device
from lightinfer.quant.config import QuantConfig
from lightinfer.quant.export import AtomicOutputDir, check_output_dir, write_checkpoint
from lightinfer.quant.layer_io import is_moe_linear, load_layer, per_expert_source, quantized_linear_shapes


@dataclass
class QuantSummary:
    """What a ``quantize`` run did (all sizes in bytes, times in seconds)."""

    out: str
    method: str
    group_size: int
    checkpoint_format: str
    group_size_reason: str
    device: str
    num_layers: int
    calib_tokens: int
    seconds: float
    peak_memory_bytes: int
    peak_memory_kind: str
    source_bytes: int
    fp16_bytes: int
    output_bytes: int
    linear_fp16_bytes: int
    linear_quant_bytes: int
    layer_info: list[dict[str, float]] = field(default_factory=list)
    moe_experts: int = 0
    moe_rtn_experts: int = 0

    @property
    def linear_ratio(self) -> float:
        """Quantized linear bytes (qweight + qzeros + scales) / their fp16 bytes."""
        return self.linear_quant_bytes / max(self.linear_fp16_bytes, 1)

    def format(self) -> str:
        """The human-readable summary the CLI prints."""
        mib = 2**20
        return "\n".join([
            f"quantized ({self.method.upper()}, W4, group size {self.group_size}) -> {self.out} ({self.checkpoint_format} format)",
            f"  {self.group_size_reason}",
            (f"  size: source files {self.source_bytes / mib:.1f} MiB, fp16 {self.fp16_bytes / mib:.1f} MiB"
             f" -> {self.output_bytes / mib:.1f} MiB (model.safetensors)"),
            (f"  linear weights: {self.linear_fp16_bytes / mib:.1f} MiB fp16 -> {self.linear_quant_bytes / mib:.1f}"
             f" MiB ({self.linear_ratio:.3f} of fp16, scales and zeros included)"),
            f"  layers: {self.num_layers}, calibration tokens: {self.calib_tokens}, device: {self.device}",
            (f"  time: {self.seconds:.1f} s, peak memory: {self.peak_memory_bytes / mib:.0f} MiB"
             f" ({self.peak_memory_kind})"),
            *([self.experts_line()] if self.moe_experts else []),
        ])

    def experts_line(self) -> str:
        """MoE models: how many experts were quantized with RTN rather than AWQ."""
        from lightinfer.quant.awq_moe import MIN_EXPERT_TOKENS

        if self.method != "awq":
            return f"  experts: {self.moe_experts}, all with RTN (method {self.method})"
        return (f"  experts: {self.moe_experts}; {self.moe_rtn_experts} quantized with RTN (fewer than "
                f"{MIN_EXPERT_TOKENS} routed calibration tokens), {self.moe_experts - self.moe_rtn_experts} with AWQ "
                f"on the tokens routed to them")


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "GPU, torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS high-water mark"


def _progress(total: int, enabled: bool, desc: str):  # type: ignore[no-untyped-def]
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="layer", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def quantize(
    src: str, out: str | Path, config: QuantConfig | None = None, *, force: bool = False, progress: bool = True
) -> QuantSummary:
    """Quantize ``src`` into a checkpoint at ``out`` (``config.format``: compressed-tensors or AutoAWQ "gemm").

    Args:
        src: anything ``LLM`` accepts: a Hugging Face folder, a ``.gguf`` file, ``smollm2-135m-instruct``.
        out: the output folder (created; must be empty or absent unless ``force``).
        config: settings (default ``QuantConfig()``: AWQ, W4, group size auto).
        force: replace a non-empty ``out``.
        progress: show a per-layer progress bar (stderr).
    Returns:
        :class:`QuantSummary`.
    Raises:
        ValueError: unsupported architecture, an already quantized source, a group size that
            does not divide a layer, a too-short calibration text, NaN/inf weights (named).
        FileExistsError: non-empty ``out`` without ``force``.
        FileNotFoundError: ``src`` or the calibration file not found.
        KeyboardInterrupt: re-raised after removing the temporary output.
    """
    from lightinfer.loader import Checkpoint
    from lightinfer.models.registry import architecture_of, get_model_class, quantizable_architectures

    cfg = config or QuantConfig()
    t0 = time.monotonic()
    check_output_dir(out, force)
    ckpt = Checkpoint(src)
    hf = ckpt.hf_config
    if ckpt.quant_config is not None and not ckpt.is_gguf:  # a GGUF is read dequantized: full precision in
        raise ValueError(f"{src} is already quantized ({ckpt.quant_config.get('quant_method')}); give full-precision weights")
    arch = architecture_of(hf)
    model_cls = get_model_class(hf)  # an architecture we do not run: the message lists those we do
    table = model_cls.awq_table
    if table is None:
        raise ValueError(f"architecture {arch} cannot be quantized; supported: {', '.join(quantizable_architectures())}")
    # (out_features, in_features) of each quantized linear of a decoder layer (MoE experts as expert 0).
    shapes, first_layer = quantized_linear_shapes(model_cls, hf)
    num_layers = int(hf.num_hidden_layers)
    tables = [model_cls.awq_table_for(hf, i) for i in range(num_layers)]
    keep_fp = tuple(n for n in shapes if cfg.skips(n))
    moe_kept = [n for n in keep_fp if any(is_moe_linear(t, n) for t in tables)]
    if moe_kept:
        raise ValueError(f"modules_to_not_convert={cfg.modules_to_not_convert} names MoE expert linears "
                         f"({', '.join(moe_kept)}): experts are always quantized (their routers stay dense)")
    in_features = {f"model.layers.{first_layer[n]}.{n}": k for n, (_, k) in shapes.items() if n not in keep_fp}
    if not in_features:
        raise ValueError(f"modules_to_not_convert={cfg.modules_to_not_convert} leaves no linear to quantize")
    group_size, reason = cfg.resolve_group_size(in_features)
    for n, (o, _) in shapes.items():
        if o % 8 and n not in keep_fp:
            raise ValueError(f"model.layers.{first_layer[n]}.{n}: out_features {o} is not a multiple of 8 (AWQ packing)")
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokenizer = ckpt.load_tokenizer()  # a broken or code-requiring tokenizer fails now, not after the layers

    num_experts = model_cls.moe_spec.num_experts_of(hf) if model_cls.moe_layer_ids(hf) else 0
    names, get_tensor = per_expert_source(ckpt.tensor_names(), ckpt.get_tensor, num_experts)  # GGUF's stacks split
    by_layer: dict[int, list[str]] = {}
    other: list[str] = []
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        (by_layer.setdefault(int(m.group(1)), []) if m else other).append(n)

    hidden: list[torch.Tensor] = []
    calib_tokens = 0
    seq_len = cfg.seq_len
    if cfg.method == "awq":
        from lightinfer.quant.calib import calibration_samples

        samples = calibration_samples(tokenizer, cfg.calib, cfg.num_samples, cfg.seq_len)
        ids = torch.tensor(samples, dtype=torch.long)  # [S, L]
        seq_len = ids.shape[1]
        calib_tokens = ids.numel()
        embed = ckpt.get_tensor("model.embed_tokens.weight").to(device, torch.float32)
        embed *= model_cls.input_embedding_scale(hf)  # Gemma scales its embeddings by sqrt(hidden)
        per_chunk = max(1, min(ids.shape[0], 4096 // seq_len))
        hidden = [F.embedding(c.reshape(-1).to(device), embed) for c in ids.split(per_chunk)]
        del embed

    tensors: dict[str, torch.Tensor] = {}
    layer_info: list[dict[str, float]] = []
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    linear_fp16 = linear_q = fp16_total = 0
    moe_experts = moe_rtn = 0  # experts quantized, and of those with RTN
    with AtomicOutputDir(out, force) as tmp:
        bar = _progress(num_layers, progress, f"{cfg.method.upper()} W4 g{group_size}")
        try:
            for i in range(num_layers):
                prefix = f"model.layers.{i}"
                if cfg.method == "awq":
                    from lightinfer.quant.awq import quantize_layer
                    from lightinfer.quant.awq_moe import quantize_moe_block

                    layer = model_cls.decoder_layer_cls(hf, i, quant_config=None, dtype=torch.float32)
                    load_layer(layer, prefix, get_tensor)
                    layer.to(device)
                    lt, hidden, info = quantize_layer(
                        layer, tables[i], hidden, seq_len, group_size, cfg.n_grid, cfg.max_shrink, prefix, keep_fp,
                        quantize_moe_block)
                    del layer
                    layer_info.append(info)
                    moe_experts += int(info.get("moe.num_experts", 0))
                    moe_rtn += int(info.get("moe.rtn_experts", 0))
                else:
                    from lightinfer.quant.rtn import quantize_layer_rtn

                    lt = quantize_layer_rtn(
                        get_tensor, by_layer.get(i, []), tables[i], prefix, group_size, device, keep_fp)
                    if tables[i] is not None and tables[i].moe is not None:
                        moe_experts += model_cls.moe_spec.num_experts_of(hf)
                        moe_rtn = moe_experts
                tensors.update(lt)
                bar.update(1)
        finally:
            bar.close()
        for n in other:
            if (tied and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"):
                continue
            tensors[n] = ckpt.get_tensor(n).to(torch.float16)
        for n, t in tensors.items():
            if n.endswith(".qweight"):
                o, k = t.shape[1] * 8, t.shape[0]
                linear_fp16 += o * k * 2
                base = n[: -len(".qweight")]
                linear_q += sum(tensors[f"{base}.{x}"].nbytes for x in ("qweight", "qzeros", "scales"))
                fp16_total += o * k * 2
            elif not n.endswith((".qzeros", ".scales")):
                fp16_total += t.numel() * 2
        qdict = cfg.to_hf_dict(group_size)
        routers = sorted({p.rsplit(".", 1)[-1] for t in tables if t is not None and t.moe is not None
                          for p in t.moe.dense})
        if routers:  # MoE routers (and Qwen2-MoE's shared-expert gate) stay dense: say so to other readers
            qdict["modules_to_not_convert"] = sorted({*(qdict["modules_to_not_convert"] or []), *routers})
        output_bytes = write_checkpoint(tmp, tensors, hf.to_dict(), qdict, cfg.format)
        ckpt.save_tokenizer_and_generation_config(tmp)
    peak, kind = _peak_memory(device)
    return QuantSummary(
        out=str(Path(out).resolve()), method=cfg.method, group_size=group_size, checkpoint_format=cfg.format,
        group_size_reason=reason,
        device=str(device), num_layers=num_layers, calib_tokens=calib_tokens, seconds=time.monotonic() - t0,
        peak_memory_bytes=peak, peak_memory_kind=kind, source_bytes=ckpt.source_bytes, fp16_bytes=fp16_total,
        output_bytes=output_bytes, linear_fp16_bytes=linear_fp16, linear_quant_bytes=linear_q, layer_info=layer_info,
        moe_experts=moe_experts, moe_rtn_experts=moe_rtn,
    )
