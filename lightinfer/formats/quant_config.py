"""Reading a checkpoint's ``quantization_config``: refuse what cannot run, before any weight is read,
and decide each linear's run-time layout from the tensors on disk.

Keys are checked against what each producer writes (AutoAWQ / transformers' ``AwqConfig``; GPTQModel,
AutoGPTQ and optimum; compressed-tensors / llm-compressor). A key lightinfer does not know is refused:
it may change how the tensors must be read (a rotation, an adapter, per-module bit widths), and a
silently wrong model is worse than a clear error. Keys that only record how the model was made
(``damp_percent``, ``meta``, ``observer``...) pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightinfer.formats.scheme import LINEAR_FORMATS_KEY, LinearFormat, check_group_size

QUANT_METHODS = ("awq", "gptq", "compressed-tensors")

AWQ_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert", "backend",
            "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config", "format", "checkpoint_format",
            "method", "pack_dtype", "meta", "sym", "desc_act", "lm_head", "true_sequential", "damp_percent"}
SUPPORTED_AWQ = {"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}

GPTQ_KEYS = {
    # what the tensors mean: checked below
    "quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "format", "method", "pack_dtype",
    "lm_head", "dynamic", "is_marlin_format", "adapter", "rotation",
    # how the model was quantized or is to be run elsewhere: no effect on the stored tensors
    "meta", "static_groups", "true_sequential", "damp_percent", "damp_auto_increment", "model_name_or_path",
    "model_file_base_name", "quantizer", "v2", "v2_alpha", "mse", "act_group_aware", "hyb_act", "fail_safe",
    "offload_to_disk", "offload_to_disk_path", "pack_impl", "device", "tokenizer", "dataset", "batch_size",
    "pad_token_id", "use_exllama", "exllama_config", "use_cuda_fp16", "model_seqlen", "block_name_to_quantize",
    "module_name_preceding_first_block", "max_input_length", "cache_block_outputs", "modules_in_block_to_quantize",
    "backend", "disable_exllama",
}
GPTQ_FORMATS = ("gptq", "gptq_v2")

CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
           "global_compression_ratio", "sparsity_config", "moe_sparsity_config", "transform_config", "version",
           "provider"}
CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                  "actorder", "observer", "observer_kwargs", "zp_dtype", "scale_dtype"}


def _where(path: object) -> str:
    return f"{path}: quantization_config" if path else "quantization_config"


def _unknown(keys: object, known: set[str], where: str, what: str) -> None:
    """Refuse keys outside ``known`` (lightinfer's own per-module map excepted)."""
    extra = sorted(set(keys) - known - {LINEAR_FORMATS_KEY})
    if extra:
        raise ValueError(
            f"{where} has key(s) {', '.join(map(repr, extra))} unknown to lightinfer's reader of "
            f"quantization_config.quant_method={what!r}; they may change how the weights must be read, so the "
            f"checkpoint is refused rather than run wrongly. If they only record how the model was quantized, "
            f"delete them from config.json.")


def _falsy(qc: dict, key: str, where: str, why: str) -> None:
    if qc.get(key):
        raise ValueError(f"{where}.{key}={qc[key]!r} is not supported ({why})")


# ------------------------------------------------------------------------------------------ GPTQ
@dataclass(frozen=True)
class GPTQSpec:
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str  # "gptq" (zeros stored minus one) or "gptq_v2"


def parse_gptq(qc: dict, path: object = None) -> GPTQSpec:
    """Validate a GPTQ ``quantization_config``.

    Raises:
        ValueError: unknown keys, bits other than 4/8, a packing, format or option lightinfer cannot read.
    """
    where = _where(path)
    _unknown(qc, GPTQ_KEYS, where, "gptq")
    bits = qc.get("bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ValueError(f"{where}.bits={bits!r} is not supported: GPTQ checkpoints run with 4-bit (W4A16 kernels) "
                         f"or 8-bit (W8A16) weights; 2- and 3-bit codes have no kernel here")
    fmts = {str(qc[k]).lower() for k in ("checkpoint_format", "format") if qc.get(k) is not None}
    if len(fmts) > 1 or not fmts <= set(GPTQ_FORMATS):
        raise ValueError(f"{where}.checkpoint_format/format={sorted(fmts)} is not supported: lightinfer reads the "
                         f"{' and '.join(GPTQ_FORMATS)} formats (a marlin/bitblas repack is not read back)")
    if str(qc.get("method", "gptq")).lower() != "gptq":
        raise ValueError(f"{where}.method={qc['method']!r} is not supported with quant_method 'gptq'")
    if qc.get("pack_dtype", "int32") not in ("int32", None):
        raise ValueError(f"{where}.pack_dtype={qc['pack_dtype']!r} is not supported: only int32 packing")
    _falsy(qc, "lm_head", where, "a quantized lm_head is not read; keep it in 16 bits")
    _falsy(qc, "dynamic", where, "per-module overrides of bits / group size are not read")
    _falsy(qc, "is_marlin_format", where, "re-export the checkpoint in the gptq format")
    _falsy(qc, "adapter", where, "an EoRA/LoRA adapter on the quantized weights is not applied")
    _falsy(qc, "rotation", where, "rotated (Hadamard) weights need the rotation at run time")
    sym = qc.get("sym", True)
    desc_act = qc.get("desc_act", False)
    for key, value in (("sym", sym), ("desc_act", desc_act)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}.{key}={value!r} must be true or false")  # noqa: TRY004 - bad input: ValueError
    return GPTQSpec(int(bits), qc.get("group_size"), sym, desc_act, fmts.pop() if fmts else "gptq")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ compressed-tensors
@dataclass(frozen=True)
class CTScheme:
    """One ``config_groups`` entry: which modules (``targets``) and how their weights are stored."""

    targets: tuple[str, ...]
    num_bits: int
    symmetric: bool
    strategy: str  # "group" | "channel"
    group_size: int  # -1 for channel
    actorder: str | None

    def matches(self, module: str) -> bool:
        return any(_ct_match(t, module) for t in self.targets)


def _ct_match(target: str, module: str) -> bool:
    """compressed-tensors target / ignore matching: ``re:<regex>`` (re.match on the module name), a
    class name (``Linear``: every linear reaches here), or a module name (exact or a dotted suffix)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return True
    return module == target or module.endswith("." + target)


def parse_compressed_tensors(qc: dict, path: object = None) -> tuple[list[CTScheme], list[str]]:
    """Validate a compressed-tensors ``quantization_config``; returns ``(schemes, ignore)``.

    Raises:
        ValueError: unknown keys, a format other than pack-quantized, activation / KV-cache
            quantization, sparsity or transforms, int types other than 4/8-bit weights, a strategy
            other than group / channel.
    """
    where = _where(path)
    _unknown(qc, CT_KEYS, where, "compressed-tensors")
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"{where}.format={fmt!r} is not supported: lightinfer reads compressed-tensors "
                         f"'pack-quantized' int4/int8 weights only (re-save the model with format pack-quantized)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status={status!r} is not supported: the weights must be stored "
                         f"compressed (packed), as llm-compressor saves them")
    _falsy(qc, "kv_cache_scheme", where, "KV-cache quantization comes from lightinfer's kv_cache_dtype")
    _falsy(qc, "sparsity_config", where, "sparse weights are not read")
    _falsy(qc, "moe_sparsity_config", where, "sparse weights are not read")
    _falsy(qc, "transform_config", where, "transformed (rotated) weights need the transform at run time")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups is missing or empty: nothing says how the weights are stored")
    schemes = []
    for gname, g in groups.items():
        gw = f"{where}.config_groups.{gname}"
        _unknown(g, CT_GROUP_KEYS, gw, "compressed-tensors")
        if g.get("format") not in (None, "pack-quantized"):
            raise ValueError(f"{gw}.format={g['format']!r} is not supported: only pack-quantized")
        for act in ("input_activations", "output_activations"):
            if g.get(act):
                raise ValueError(f"{gw}.{act} is set: activation quantization (W4A8, W8A8...) is not supported; "
                                 f"lightinfer runs weight-only (W4A16 / W8A16) checkpoints")
        w = g.get("weights") or {}
        _unknown(w, CT_WEIGHT_KEYS, f"{gw}.weights", "compressed-tensors")
        bits, typ, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if typ != "int" or bits not in (4, 8):
            raise ValueError(f"{gw}.weights: type={typ!r} num_bits={bits!r} is not supported: int 4-bit (W4A16 "
                             f"kernels) or int 8-bit (W8A16)")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{gw}.weights.strategy={strategy!r} is not supported: 'group' or 'channel'")
        if w.get("dynamic"):
            raise ValueError(f"{gw}.weights.dynamic={w['dynamic']!r}: dynamic weight scales are not supported")
        if w.get("block_structure"):
            raise ValueError(f"{gw}.weights.block_structure={w['block_structure']!r}: block scales are not supported")
        actorder = w.get("actorder")
        if actorder not in (None, "weight", "static", "group", "dynamic"):
            raise ValueError(f"{gw}.weights.actorder={actorder!r} is not supported")
        group = w.get("group_size") if strategy == "group" else -1
        targets = g.get("targets") or []
        schemes.append(CTScheme(tuple([targets] if isinstance(targets, str) else targets), int(bits),
                                bool(w.get("symmetric", True)), strategy, group, actorder))
    ignore = qc.get("ignore") or []
    return schemes, [ignore] if isinstance(ignore, str) else list(ignore)


def ct_scheme_for(schemes: list[CTScheme], ignore: list[str], module: str) -> CTScheme | None:
    """The scheme that quantizes ``module`` (None: ignored or not targeted)."""
    if any(_ct_match(t, module) for t in ignore):
        return None
    return next((s for s in schemes if s.matches(module)), None)


# ------------------------------------------------------------------------------------------ all
def check_quant_config(qc: dict | None, hf_config: object, path: object = None) -> None:
    """Refuse a ``quantization_config`` lightinfer cannot run, before loading anything.

    Raises:
        ValueError: naming the field, its value and what is supported.
    """
    if qc is None:
        return
    from lightinfer.models.registry import get_model_class

    where = _where(path)
    method = str(qc.get("quant_method", "")).lower()
    if method == "gguf":  # made by the GGUF reader from the file's tensor types
        return
    if method not in QUANT_METHODS:
        raise ValueError(f"{where}.quant_method={qc.get('quant_method')!r} is not supported; lightinfer runs "
                         f"{', '.join(QUANT_METHODS)} checkpoints and GGUF files")
    sizes = get_model_class(hf_config).linear_input_sizes(hf_config)
    if method == "awq":
        _unknown(qc, AWQ_KEYS, where, "awq")
        for key, want in SUPPORTED_AWQ.items():
            got = qc.get(key, want if key in ("version", "zero_point") else None)
            if isinstance(got, str) and isinstance(want, str):
                got = got.lower()
            if got != want:
                raise ValueError(
                    f"{where}.{key}={got!r} is not supported; lightinfer runs AWQ checkpoints with "
                    f"{', '.join(f'{k}={v!r}' for k, v in SUPPORTED_AWQ.items())} (AutoAWQ 'gemm' format)")
        group = qc.get("group_size")
        if not isinstance(group, int) or group <= 0 or any(v % group for v in sizes.values()):
            raise ValueError(f"{where}.group_size={group!r} must be a positive divisor of every quantized "
                             f"layer's input size ({', '.join(f'{k}={v}' for k, v in sizes.items())})")
    elif method == "gptq":
        spec = parse_gptq(qc, path)
        check_group_size(spec.group_size, sizes, spec.bits, f"{where}")
    else:
        schemes, _ = parse_compressed_tensors(qc, path)
        for s in schemes:
            check_group_size(s.group_size, sizes, s.num_bits, f"{where}.config_groups")


# Tensor name suffix that marks a quantized linear, per method.
QUANTIZED_SUFFIX = {"awq": ".qweight", "gptq": ".qweight", "compressed-tensors": ".weight_packed"}


def linear_formats(qc: dict, tensor_names: list[str], path: object = None) -> dict[str, LinearFormat]:
    """Every quantized linear of a checkpoint -> its :class:`LinearFormat`, from the tensor names.

    Modules with ``qweight`` (AWQ, GPTQ) or ``weight_packed`` (compressed-tensors) are quantized;
    everything else loads dense.

    Raises:
        ValueError: a compressed-tensors module with packed weights that no config group targets.
    """
    method = str(qc.get("quant_method", "")).lower()
    suffix = QUANTIZED_SUFFIX[method]
    modules = [n[: -len(suffix)] for n in tensor_names if n.endswith(suffix)]
    names = set(tensor_names)
    if method == "awq":
        return {m: LinearFormat("w4", int(qc["group_size"]), False, "AWQ") for m in modules}
    if method == "gptq":
        spec = parse_gptq(qc, path)
        return {m: LinearFormat("w4" if spec.bits == 4 else "w8", int(spec.group_size), spec.sym, "GPTQ",
                                spec.desc_act and f"{m}.g_idx" in names) for m in modules}
    schemes, ignore = parse_compressed_tensors(qc, path)
    out = {}
    for m in modules:
        s = ct_scheme_for(schemes, ignore, m)
        if s is None:
            raise ValueError(f"{_where(path)}: {m} has packed weights but no config_groups entry targets it "
                             f"(or it is in ignore)")
        out[m] = LinearFormat("w4" if s.num_bits == 4 else "w8", s.group_size, s.symmetric, "compressed-tensors",
                              f"{m}.weight_g_idx" in names)
    return out


def with_linear_formats(qc: dict, formats: dict[str, LinearFormat]) -> dict:
    """A copy of ``qc`` carrying the per-module map (:data:`LINEAR_FORMATS_KEY`) for ``make_linear``."""
    return {**qc, LINEAR_FORMATS_KEY: formats}
