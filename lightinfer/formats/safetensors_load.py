"""Quantized safetensors checkpoints (AWQ, GPTQ, compressed-tensors): the per-module check before
anything is allocated, and the repack into the run-time layouts while the weights stream in.

The check (:func:`check_quantized_tensors`) reads only the small tensors of every quantized layer
(scales, zeros, ``g_idx``, ``weight_shape``) and the headers of the large ones, so a wrong layout,
NaN/inf scales or a broken ``g_idx`` is reported, naming the file and tensor, before the model is
built. The load (:class:`QuantizedLoader`) collects each layer's tensors as the shards are read and
converts a layer as soon as it has all of them: at most one layer's tensors wait in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from lightinfer.formats.compressed_tensors import CT_PARTS, check_ct_tensors, ct_to_runtime
from lightinfer.formats.gptq import GPTQ_PARTS, check_gptq_tensors, gptq_to_runtime
from lightinfer.formats.packing import check_finite
from lightinfer.formats.quant_config import ct_scheme_for, parse_compressed_tensors, parse_gptq
from lightinfer.formats.scheme import LINEAR_FORMATS_KEY, LinearFormat

AWQ_PARTS = ("qweight", "qzeros", "scales")
PARTS = {"awq": AWQ_PARTS, "gptq": GPTQ_PARTS, "compressed-tensors": CT_PARTS}
# Read only as a header (shape and dtype) by the check: the codes, the bulk of every layer.
LARGE = {"qweight", "weight_packed"}
_ST_DTYPES = {"I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
              "BOOL": torch.bool}


def method_of(qc: dict) -> str:
    return str(qc.get("quant_method", "")).lower()


def _meta(f: object, name: str) -> torch.Tensor:
    """A meta tensor with the shape and dtype a safetensors header gives ``name`` (no data read)."""
    sl = f.get_slice(name)  # type: ignore[attr-defined]
    return torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.uint8), device="meta")


def check_quantized_tensors(qc: dict, formats: dict[str, LinearFormat], weight_map: dict[str, Path]) -> None:
    """Check every quantized layer's tensors (module docstring) before the model is built.

    Raises:
        ValueError: a missing tensor, a layout that does not match the config, NaN/inf scales, a
            ``g_idx`` that does not cover every group; each names the file and the tensor.
    """
    from safetensors import safe_open

    method = method_of(qc)
    parts_of = PARTS[method]
    gptq = parse_gptq(qc) if method == "gptq" else None
    schemes = parse_compressed_tensors(qc) if method == "compressed-tensors" else None
    by_file: dict[Path, list[str]] = {}
    for module in formats:
        for p in parts_of:
            if f"{module}.{p}" in weight_map:
                by_file.setdefault(weight_map[f"{module}.{p}"], []).append(f"{module}.{p}")
    seen: dict[str, dict[str, torch.Tensor]] = {}
    for fpath, names in by_file.items():
        with safe_open(str(fpath), framework="pt") as f:
            for n in names:
                module, _, leaf = n.rpartition(".")
                seen.setdefault(module, {})[leaf] = _meta(f, n) if leaf in LARGE else f.get_tensor(n)
    for module, parts in seen.items():
        fpath = weight_map.get(f"{module}.{parts_of[0]}", "checkpoint")
        required = [p for p in parts_of if p not in ("g_idx", "weight_g_idx", "weight_zero_point")]
        missing = [p for p in required if p not in parts]
        if method == "awq" and not missing:
            check_finite(parts["scales"], f"{fpath}: {module}.scales", module)
        if missing:
            raise ValueError(f"{fpath}: {module} has {', '.join(sorted(parts))} but lacks "
                             f"{', '.join(f'{module}.{p}' for p in missing)}")
        if gptq is not None:
            check_gptq_tensors(parts, gptq, module, fpath)
        elif schemes is not None:
            check_ct_tensors(parts, ct_scheme_for(*schemes, module), module, fpath)  # type: ignore[arg-type]


class QuantizedLoader:
    """Collects each quantized layer's tensors during the stream and loads the layer when complete.

    Args:
        qc: the checkpoint's ``quantization_config`` (with its per-module map).
        modules: module name -> ``W4A16Linear`` / ``W8A16Linear`` of the model.
        tensor_names: every tensor name in the checkpoint (which optional parts exist).
        file_of: tensor name -> its file, for error messages.
    """

    def __init__(self, qc: dict, modules: dict[str, torch.nn.Module], tensor_names: set[str],
                 file_of: Callable[[str], object]) -> None:
        self.method = method_of(qc)
        self.parts_of = PARTS[self.method]
        self.modules = modules
        self.file_of = file_of
        self.gptq = parse_gptq(qc) if self.method == "gptq" else None
        self.schemes = parse_compressed_tensors(qc) if self.method == "compressed-tensors" else None
        self.formats: dict[str, LinearFormat] = qc.get(LINEAR_FORMATS_KEY, {})
        self.expected = {m: {p for p in self.parts_of if f"{m}.{p}" in tensor_names} for m in modules}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: dict[str, str] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` if it is part of a quantized layer (True), loading the layer once complete."""
        module, _, leaf = name.rpartition(".")
        if module not in self.modules or leaf not in self.parts_of:
            return False
        parts = self.pending.setdefault(module, {})
        parts[leaf] = tensor
        if set(parts) >= self.expected[module]:
            self._load(module, self.pending.pop(module))
        return True

    def _load(self, module_name: str, parts: dict[str, torch.Tensor]) -> None:
        layer = self.modules[module_name]
        fmt = self.formats.get(module_name, LinearFormat("w4", getattr(layer, "group_size", 0), False, "AWQ"))
        file = self.file_of(f"{module_name}.{self.parts_of[0]}")
        if self.method == "awq":
            layer.load_awq(parts["qweight"], parts["qzeros"], parts["scales"])
        else:
            dtype = layer.scales.dtype if fmt.kind == "w4" else torch.float32
            convert = gptq_to_runtime if self.gptq is not None else ct_to_runtime
            spec = self.gptq if self.gptq is not None else ct_scheme_for(*self.schemes, module_name)  # type: ignore[misc]
            layer.load_runtime(*convert(parts, spec, layer.group_size, dtype, module_name, file))
        self.done[module_name] = fmt.describe()

    def missing(self) -> list[str]:
        """Quantized layers never completed (named by their first missing tensor)."""
        out = [f"{m}.{min(self.expected[m] - set(p))}" for m, p in self.pending.items()]
        out += [f"{m}.{self.parts_of[0]}" for m in self.modules if m not in self.done and m not in self.pending]
        return out


def load_safetensors_weights(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], qc: dict | None,
                             tensor_names: set[str], file_of: Callable[[str], object]) -> dict[str, str]:
    """Stream ``(name, tensor)`` pairs into ``model``: dense parameters copied (cast to their dtype),
    quantized layers collected and repacked by :class:`QuantizedLoader`.

    Returns:
        Module name -> how it was loaded, for the start-up summary.
    Raises:
        ValueError: a shape mismatch or a missing tensor (named).
    """
    from lightinfer.layers.linear import Linear, W4A16Linear, W8A16Linear
    from lightinfer.layers.moe_loading import expert_views, stacked_parameter_names

    params = dict(model.named_parameters())
    quant_modules = {n: m for n, m in model.named_modules() if isinstance(m, (W4A16Linear, W8A16Linear))}
    # MoE experts: one view per expert projection into the layer's stacked tensors (layers/moe_loading.py)
    for n in stacked_parameter_names(model):
        del params[n]
    experts = expert_views(model)
    quant_modules.update({n: v for n, v in experts.items() if v.quantized})
    dense_experts = {f"{n}.weight": v for n, v in experts.items() if not v.quantized}
    quant = QuantizedLoader(qc or {"quant_method": "awq"}, quant_modules, tensor_names, file_of) \
        if quant_modules else None
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in tensors:
        if tied and name == "lm_head.weight":
            continue
        if quant is not None and quant.take(name, tensor):
            continue
        if name in dense_experts:
            dense_experts[name].load_dense(tensor)
            loaded.add(name)
            continue
        if name not in params:
            continue  # e.g. rotary inv_freq buffers some exporters write
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    missing += [n for n in dense_experts if n not in loaded]
    missing += quant.missing() if quant is not None else []
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:5])}")
    report = dict(quant.done) if quant is not None else {}
    report.update({n[: -len(".weight")]: "dense" for n in dense_experts})
    for n, m in model.named_modules():
        if isinstance(m, Linear) or n in ("model.embed_tokens", "lm_head"):
            report[n] = "tied to embed_tokens" if tied and n == "lm_head" else "dense"
    return report
