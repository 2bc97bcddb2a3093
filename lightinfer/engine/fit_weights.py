"""The weight side of ``lightinfer fit``: what a model's weights take on the GPU, by part, from its config and
tensor headers only (no tensor data is read).

* The 4-bit plan (what ``lightinfer quantize`` writes) comes from the model class's
  :meth:`~lightinfer.models.base.CausalLM.weight_bytes_by_part`, the same arithmetic as the engine's MoE advice.
* The checkpoint as it is: the model is built on the meta device (nothing is allocated) with the layouts its
  headers call for: a GGUF file's tensor types, a safetensors checkpoint's ``quantization_config`` matched to
  its tensor names. Each module then holds exactly the tensors the engine would allocate for it (a Q6_K
  tensor runs as W8 with fp32 scales per 16, more than its 6.6 bits on disk), so the sum is what the engine
  will hold, not the file size.
* Both add the model's buffers (the fp32 rotary table), which the engine holds on the GPU too.
* MoE experts moved to host memory (``--cpu-experts``) get a CPU copy there (``kernels/moe_cpu.py``) that replaces
  their W4 stacks (released); what it adds beyond them is counted per layer by the kernel's own rule on the
  stacks the engine would build (``FusedMoE.cpu_copy_nbytes``): 0 for the int4 copy of W4 experts.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from lightinfer.engine.moe_placement import expert_bytes_by_layer, expert_copy_bytes_by_layer
from lightinfer.formats.scheme import LINEAR_FORMATS_KEY
from lightinfer.loader import Checkpoint
from lightinfer.models.registry import get_model_class
from lightinfer.models.sizes import PARTS

BUFFERS = "rotary table"
# Parameter name -> part (first match wins; norms before attention: Qwen3's q/k norms count as norms, as in sizes.py)
_PART_PATTERNS = (
    ("embed_tokens", re.compile(r"embed_tokens\.")),
    ("lm_head", re.compile(r"^lm_head\.")),
    ("norms", re.compile(r"norm\.")),
    ("experts", re.compile(r"\.experts\.")),
    ("router and shared experts", re.compile(r"\.(gate|shared_expert|shared_expert_gate)\.")),
    ("attention", re.compile(r"\.self_attn\.")),
    ("mlp", re.compile(r"\.(mlp|block_sparse_moe)\.")),
)


@dataclass
class WeightPlan:
    """A model's weights at one precision.

    Attributes:
        label: what they are, e.g. "W4 g128" or "GGUF Q4_1".
        parts: bytes by part (:data:`~lightinfer.models.sizes.PARTS` plus the rotary table).
        tied: the LM head shares the input embedding (which then stays on the GPU).
        expert_bytes: bytes of each MoE layer's experts, in layer order (empty for a dense model).
        expert_copy_bytes: bytes the CPU copy each MoE layer's experts get in host memory when they compute there
            (``--cpu-experts``) adds beyond the W4 stacks it releases, in layer order (0 for W4 experts with
            16-bit activations, whose int4 copy has the stacks' size, and for dense 16-bit ones).
        w4: dense linears run through the 4-bit GEMM (its dequant slabs add to the activation peak).
        file_bytes: the checkpoint's tensor bytes as its headers give them (None: computed, no file).
    """

    label: str
    parts: dict[str, int]
    tied: bool
    expert_bytes: list[int] = field(default_factory=list)
    w4: bool = False
    file_bytes: int | None = None
    expert_copy_bytes: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def host_bytes(self, embedding_on_host: bool) -> int:
        """Bytes the engine keeps in host memory: the input embedding when it stays there (an untied one)."""
        return self.parts["embed_tokens"] if embedding_on_host and not self.tied else 0


def _buffer_bytes(model: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in {id(b): b for b in model.buffers()}.values())


def _meta_model(hf_config: object, quant_config: dict | None, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return get_model_class(hf_config)(hf_config, quant_config, dtype)


def _expert_copies(model: torch.nn.Module) -> list[int]:
    """The CPU copy of each MoE layer's experts (``expert_copy_bytes_by_layer``), in layer order."""
    by_layer = expert_copy_bytes_by_layer(model)
    return [by_layer[i] for i in sorted(by_layer)]


def parts_of_model(model: torch.nn.Module) -> dict[str, int]:
    """Bytes by part of a (meta-device) model: every parameter and buffer once (a tied head counts under
    ``embed_tokens``), classified by name."""
    parts = dict.fromkeys((*PARTS, BUFFERS), 0)
    seen: set[int] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        if "rotary" in name or name.endswith(("cos_cache", "sin_cache")):
            parts[BUFFERS] += nbytes
            continue
        part = next((p for p, rx in _PART_PATTERNS if rx.search(name)), "attention" if "attn" in name else "mlp")
        parts[part] += nbytes
    return parts


def w4_plan(hf_config: object, dtype: torch.dtype) -> WeightPlan:
    """What ``lightinfer quantize`` makes of the model: decoder linears W4 with the largest group size of
    128/64/32 dividing every input (its "auto"), embedding, head and norms in 16 bits.

    Raises:
        ValueError: no group size divides the layers' inputs (the model cannot be quantized to W4).
    """
    from lightinfer.dummy_weights import dummy_awq_config

    cls = get_model_class(hf_config)
    group = int(dummy_awq_config(hf_config)["group_size"])
    elem = torch.empty(0, dtype=dtype).element_size()
    parts = dict(cls.weight_bytes_by_part(hf_config, bits=4, group_size=group, dtype_bytes=elem))
    parts[BUFFERS] = _buffer_bytes(_meta_model(hf_config, None, dtype))
    moe_layers = cls.moe_layer_ids(hf_config)
    experts = [parts["experts"] // len(moe_layers)] * len(moe_layers) if moe_layers else []
    # the CPU copies from the W4 model on the meta device (nothing allocated): the stacks the engine builds
    copies = _expert_copies(_meta_model(hf_config, dummy_awq_config(hf_config), dtype)) if moe_layers else []
    return WeightPlan(f"W4 g{group}", parts, bool(getattr(hf_config, "tie_word_embeddings", False)), experts, True,
                      expert_copy_bytes=copies)


def _gguf_label(checkpoint: Checkpoint) -> str:
    """``"GGUF Q4_1"``, or with the other types by size: ``"GGUF Q4_K + Q6_K, F32"``."""
    by_type: Counter[str] = Counter()
    for t in checkpoint.gguf.tensors.values():
        by_type[t.type_name] += t.nbytes
    names = [n for n, _ in by_type.most_common()]
    return "GGUF " + names[0] + (f" + {', '.join(names[1:])}" if len(names) > 1 else "")


def checkpoint_plan(checkpoint: Checkpoint, dtype: torch.dtype) -> WeightPlan:
    """The checkpoint's weights as the engine would hold them on a GPU with activations in ``dtype``.

    A GGUF file or a safetensors folder: the model built on the meta device with the layouts its headers
    call for. A folder with only ``config.json``: dense in 16 bits (the engine's GPU dtype), or the config's
    ``quantization_config`` bits and group size.

    Raises:
        ValueError: a ``quantization_config`` lightinfer cannot run, a header that cannot be read.
    """
    from lightinfer.formats.headers import safetensors_headers
    from lightinfer.formats.quant_config import check_quant_config, linear_formats, with_linear_formats

    hf = checkpoint.hf_config
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    if checkpoint.gguf is not None:
        qc = checkpoint.gguf.quant_config()
        label, file_bytes = _gguf_label(checkpoint), sum(t.nbytes for t in checkpoint.gguf.tensors.values())
    else:
        headers = safetensors_headers(checkpoint.path)
        qc = checkpoint.quant_config
        where = checkpoint.path / "config.json"
        if qc is not None:
            check_quant_config(qc, hf, where)
        if not headers:  # a bare config: what its fields say
            return _config_only_plan(hf, qc, dtype)
        file_bytes = sum(h.nbytes for h in headers.values())
        dtypes: Counter[str] = Counter()
        for h in headers.values():
            dtypes[h.dtype] += h.nbytes
        if qc is None:
            label = f"{dtypes.most_common(1)[0][0]} safetensors"
        else:
            qc = with_linear_formats(qc, linear_formats(qc, list(headers), where))
            label = f"{qc.get('quant_method')} {qc.get('bits')}-bit g{qc.get('group_size')}"
    model = _meta_model(hf, qc, dtype)
    parts = parts_of_model(model)
    if checkpoint.gguf is not None:
        parts.update(_gguf_tables(checkpoint, dtype, tied, parts))
    formats = (qc or {}).get(LINEAR_FORMATS_KEY) or {}
    w4 = any(f.kind == "w4" for f in formats.values())
    by_layer = expert_bytes_by_layer(model)
    return WeightPlan(label, parts, tied, [by_layer[i] for i in sorted(by_layer)], w4, file_bytes,
                      _expert_copies(model))


def _gguf_tables(checkpoint: Checkpoint, dtype: torch.dtype, tied: bool, parts: dict[str, int]) -> dict[str, int]:
    """The embedding and head bytes of a GGUF model as the loader holds them: a quantized ``token_embd`` /
    ``output`` becomes a W4 or W8 table (``formats/gguf_load.py``, ``layers/quant_embed.py``) in place of the
    dense table the model is built with; a tied head shares it."""
    from lightinfer.layers.linear import W4A16Linear
    from lightinfer.layers.w8_linear import W8A16Linear

    out = {}
    for part, name in (("embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        t = checkpoint.gguf.tensors.get(name)
        if t is None or (part == "lm_head" and tied):
            continue
        fmt = checkpoint.gguf.tensor_format(name)
        if fmt.kind == "dense":
            continue
        n, k = t.shape
        with torch.device("meta"):
            table = (W4A16Linear(k, n, False, fmt.group_size, dtype) if fmt.kind == "w4"
                     else W8A16Linear(k, n, False, fmt.group_size, dtype, symmetric=fmt.symmetric))
        out[part] = sum(x.numel() * x.element_size() for x in [*table.parameters(), *table.buffers()])
    return out


def _config_only_plan(hf_config: object, qc: dict | None, dtype: torch.dtype) -> WeightPlan:
    """A folder with only ``config.json``: dense at the engine's dtype (the config's ``torch_dtype`` named in
    the label), or W-bits as its ``quantization_config`` says."""
    cls = get_model_class(hf_config)
    elem = torch.empty(0, dtype=dtype).element_size()
    bits = int(qc.get("bits") or 16) if qc else 16
    group = int(qc.get("group_size") or 128) if qc else 128
    if group <= 0:  # per channel: one scale per output row
        group = int(hf_config.hidden_size)
    parts = dict(cls.weight_bytes_by_part(hf_config, bits=bits, group_size=group, dtype_bytes=elem))
    parts[BUFFERS] = _buffer_bytes(_meta_model(hf_config, None, dtype))
    moe_layers = cls.moe_layer_ids(hf_config)
    experts = [parts["experts"] // len(moe_layers)] * len(moe_layers) if moe_layers else []
    copies = _expert_copies(_meta_model(hf_config, qc, dtype)) if moe_layers else []
    config_dtype = str(getattr(hf_config, "dtype", None) or hf_config.to_dict().get("torch_dtype") or "16-bit")
    label = (f"{qc.get('quant_method')} {bits}-bit g{group} (config only)" if qc
             else f"{config_dtype.replace('torch.', '')} (config only)")
    return WeightPlan(label, parts, bool(getattr(hf_config, "tie_word_embeddings", False)), experts, bits == 4,
                      expert_copy_bytes=copies)
