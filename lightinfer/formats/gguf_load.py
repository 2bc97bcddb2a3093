"""GGUF tensors -> a lightinfer model, one tensor at a time, without a dense copy of the weights.

Per tensor (``GGUFFile.tensor_format`` decides the layout when the model is built):

* 4-bit types (Q4_0, Q4_1, Q4_K) into ``W4A16Linear``: the file's codes repacked along K, and per
  group of 32 a scale and a zero derived in fp32 (``gguf_blocks``):

  ====== ================ =========================
  type   scale            zero
  ====== ================ =========================
  Q4_0   d                8
  Q4_1   d                -m / d
  Q4_K   d * sc           dmin * m / (d * sc)
  ====== ================ =========================

  What rounding remains: the scale and zero are stored in the activation dtype. In fp32 (the CPU
  default) that is exact up to fp32's own rounding of ``-m / d`` and ``dmin*m / (d*sc)`` (2^-24
  relative). In fp16 the Q4_K scale ``d * sc`` (17 significant bits) and a fractional zero round to
  fp16 (relative 2^-11: at most ~0.4% of a quantization step for a zero below 8); in bf16 also the
  fp16 ``d`` itself (2^-8). Codes are never re-quantized.
* Other quantized types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) into ``W8A16Linear``: the codes as int8, the
  scales and zeros in fp32, which holds every product ``d * sc`` exactly: no rounding at all.
* F32 / F16 / BF16 into the dense parameters (activation dtype).
* MoE experts, stacked per projection in the file (``blk.N.ffn_gate_exps`` ``[E, N, K]``), into
  ``FusedMoE``'s stacks (:func:`load_stacked_experts`): 4-bit types as W4 (fractional zeros kept on every
  device: the MoE kernels subtract zeros in fp32), other types dequantized once into a dense stack.

The token embedding and an untied output head of a quantized type become
``QuantizedVocabEmbedding`` / ``QuantizedLMHead`` over a W4/W8 table (tied: the head shares it).

On CUDA too, all three 4-bit types run as W4 (0.5 bytes per weight plus the group's scale and zero):
the W4 kernels subtract a fractional zero point exactly (``kernels/w4a16_gemm`` declares
``FRACTIONAL_ZEROS = True``), so what is rounded is only the storage above. A layer whose zeros are all
integers (Q4_0) is marked ``integer_zeros`` at load and takes the kernels' cheaper decode (fp16 pairs);
Q4_1 / Q4_K layers, and projections fused with one, take their exact fp32 decode (one more FADD per
weight). ``fractional_zeros_ok=False`` still loads Q4_1 / Q4_K as W8 with the same codes, scales and
zeros (exact, 1.25 bytes per weight), and so does CUDA with a kernel package that does not declare it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from lightinfer.formats.gguf_blocks import GroupCodes, unpack_blocks
from lightinfer.formats.gguf_file import STACKED_SUFFIX, GGUFFile, GGUFTensor
from lightinfer.formats.packing import check_finite
from lightinfer.formats.scheme import LinearFormat
from lightinfer.layers.embed_head import LMHead, VocabEmbedding
from lightinfer.layers.linear import Linear, W4A16Linear
from lightinfer.layers.moe import FusedMoE
from lightinfer.layers.quant_embed import QuantizedLMHead, QuantizedVocabEmbedding
from lightinfer.layers.w8_linear import W8A16Linear

logger = logging.getLogger("lightinfer")


def w4_kernels_take_fractional_zeros() -> bool:
    """Whether the Triton W4 kernels subtract a fractional zero point exactly (they declare it)."""
    try:
        from lightinfer.kernels import w4a16_gemm
    except ImportError:  # no Triton: no GPU path either
        return False
    return bool(getattr(w4a16_gemm, "FRACTIONAL_ZEROS", False))


def fractional_w4_allowed(device: torch.device) -> bool:
    """Whether W4 layers on ``device`` may hold fractional zero points: on a CPU always (the CPU path dequantizes
    in fp32), on CUDA when the Triton W4 kernels declare it (:func:`w4_kernels_take_fractional_zeros`)."""
    return device.type != "cuda" or w4_kernels_take_fractional_zeros()


def _codes(gf: GGUFFile, t: GGUFTensor) -> GroupCodes:
    """Unpack a quantized matrix, rows in transformers' order, scales checked finite."""
    gc = unpack_blocks(gf.read_raw(t), t.ggml_type, t.shape[-1])
    where = f"{gf.path}: tensor {t.gguf_name} ({t.type_name})"
    check_finite(gc.scale, where + " block scales", t.hf_name[: -len(".weight")])
    if gc.zero is not None:
        check_finite(gc.zero, where + " block minimums", t.hf_name[: -len(".weight")])
    perm = gf.row_permutation(t.hf_name)
    if perm is not None:
        gc = GroupCodes(gc.codes[perm], gc.scale[perm], None if gc.zero is None else gc.zero[perm], gc.group_size,
                        gc.bits)
    return gc


def pack_codes_w4(codes: np.ndarray) -> torch.Tensor:
    """4-bit codes uint8 ``[N, K]`` -> int32 ``[N, K // 8]``, nibble i of word j = code 8 j + i
    (``kernels.reference.pack_int4_rows``), by bytes: codes 2b and 2b + 1 share byte b, and four
    little-endian bytes are one word. Ten times faster than shifting int64 words."""
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype("<u1")
    return torch.from_numpy(np.ascontiguousarray(packed).view("<i4").astype(np.int32, copy=False))


def load_w4(layer: W4A16Linear, gc: GroupCodes) -> None:
    """GroupCodes of 4-bit codes -> the W4 run-time layout of ``layer``."""
    zero = gc.zero if gc.zero is not None else np.zeros_like(gc.scale)
    dtype = layer.scales.dtype
    layer.load_runtime(pack_codes_w4(gc.codes), torch.from_numpy(gc.scale.T.copy()).to(dtype),
                       torch.from_numpy(zero.T.copy()).to(dtype))


def load_w8(layer: W8A16Linear, gc: GroupCodes) -> None:
    """GroupCodes -> the W8 run-time layout (int8 codes; unsigned 4/5-bit codes fit as they are)."""
    codes = torch.from_numpy(np.ascontiguousarray(gc.codes).astype(np.int8, copy=False))
    zeros = None if gc.zero is None else torch.from_numpy(gc.zero.T.copy())
    if zeros is None and layer.zeros is not None:  # symmetric codes in an asymmetric layer
        zeros = torch.zeros(layer.zeros.shape)
    layer.load_runtime(codes, torch.from_numpy(gc.scale.T.copy()), zeros)


def _w8_like(layer: W4A16Linear, group_size: int) -> W8A16Linear:
    with torch.device(layer.qweight.device):
        return W8A16Linear(layer.in_features, layer.out_features, layer.bias is not None, group_size,
                           layer.scales.dtype, symmetric=False)


def _table(gf: GGUFFile, t: GGUFTensor, fmt: LinearFormat, device: torch.device, dtype: torch.dtype,
           fractional_w4_ok: bool) -> tuple[W4A16Linear | W8A16Linear, str]:
    """A quantized embedding / head table (``out = vocab``, ``in = hidden``) loaded from ``t``."""
    gc = _codes(gf, t)
    n, k = t.shape
    kind = fmt.kind
    if kind == "w4" and gc.zero is not None and np.any(gc.zero != np.round(gc.zero)) and not fractional_w4_ok:
        kind = "w8"
    with torch.device(device):
        if kind == "w4":
            table: W4A16Linear | W8A16Linear = W4A16Linear(k, n, False, gc.group_size, dtype)
            load_w4(table, gc)
        else:
            table = W8A16Linear(k, n, False, gc.group_size, dtype, symmetric=gc.zero is None)
            load_w8(table, gc)
    return table, LinearFormat(kind, gc.group_size, gc.zero is None, fmt.source).describe()


@torch.no_grad()
def load_gguf_weights(model: nn.Module, gf: GGUFFile, fractional_zeros_ok: bool | None = None) -> dict[str, str]:
    """Load every tensor of ``gf`` into ``model`` (built with ``gf.quant_config()``), tensor by tensor.

    Args:
        fractional_zeros_ok: whether W4 layers may hold fractional zero points (Q4_1 / Q4_K); None:
            yes on a CPU, and on CUDA when the W4 kernels declare it (they do: module docstring). Where
            not, those tensors load as W8 with the same codes, scales and zeros.

    Returns:
        Module name -> how it was loaded (``"W4 (GGUF Q4_1, g32)"``...), for the start-up summary.
    Raises:
        ValueError: a tensor whose shape does not match the model, NaN/inf block scales (naming the
            tensor and layer), or parameters the file lacks.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    device = next(model.parameters()).device
    fractional_w4_ok = fractional_zeros_ok if fractional_zeros_ok is not None else fractional_w4_allowed(device)
    report: dict[str, str] = {}
    loaded: set[str] = set()
    fallback_w8 = 0
    for name, t in gf.tensors.items():
        module_name = name.rsplit(".", 1)[0]
        module = modules.get(module_name)
        fmt = gf.tensor_format(name)
        if isinstance(module, FusedMoE):  # stacked experts (blk.N.ffn_*_exps) straight into the stacks
            report[name] = load_stacked_experts(module, name.rsplit(".", 1)[1], gf, t, fmt)
            loaded.update(f"{module_name}.{p}" for p in module.stacked_parameter_names)
            continue
        if isinstance(module, (VocabEmbedding, LMHead)) and fmt.kind != "dense":
            _swap_table(model, module_name, module, gf, t, fmt, device, fractional_w4_ok, tied, report)
            loaded.update(n for n in params if n.startswith(module_name + ".") or (tied and n == "lm_head.weight"))
            continue
        if isinstance(module, W4A16Linear):
            gc = _codes(gf, t)
            if gc.zero is not None and not fractional_w4_ok and np.any(gc.zero != np.round(gc.zero)):
                module = _replace(model, module_name, _w8_like(module, gc.group_size))
                load_w8(module, gc)
                fallback_w8 += 1
                report[module_name] = LinearFormat("w8", gc.group_size, False, fmt.source).describe()
            else:
                load_w4(module, gc)
                report[module_name] = fmt.describe()
            loaded.add(name)
            continue
        if isinstance(module, W8A16Linear):
            load_w8(module, _codes(gf, t))
            report[module_name] = fmt.describe()
            loaded.add(name)
            continue
        if name not in params:
            continue
        param = params[name]
        value = gf.dequantize(name)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"{gf.path}: tensor {t.gguf_name} ({name}) has shape {tuple(value.shape)}, the model "
                             f"expects {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
        loaded.add(name)
        if isinstance(module, (Linear, VocabEmbedding, LMHead)):
            report[module_name] = fmt.describe() if fmt.kind == "dense" else f"dense ({fmt.source})"
    if tied and "lm_head" not in report and "model.embed_tokens" in report and getattr(model, "lm_head", None) is not None:
        report["lm_head"] = f"tied to embed_tokens: {report['model.embed_tokens']}"
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    missing += [f"{m}.{p}{STACKED_SUFFIX}" for m, mod in model.named_modules() if isinstance(mod, FusedMoE)
                for p in ("gate", "up", "down") if f"{m}.{p}{STACKED_SUFFIX}" not in report]
    missing += [m for m, mod in model.named_modules() if isinstance(mod, (W4A16Linear, W8A16Linear))
                and m not in report and not m.endswith(".table")]
    if missing:
        raise ValueError(f"{gf.path} lacks {len(missing)} weights, e.g. {', '.join(missing[:5])}")
    if fallback_w8:
        logger.info("%d Q4_1/Q4_K tensors load as W8 (fractional zero points not allowed on W4 here); same codes "
                    "and scales, 1.25 bytes per weight", fallback_w8)
    return report


@torch.no_grad()
def load_stacked_experts(moe: FusedMoE, leaf: str, gf: GGUFFile, t: GGUFTensor, fmt: LinearFormat) -> str:
    """One stacked expert tensor (``gate_exps`` / ``up_exps`` / ``down_exps``, ``[E, N, K]``) into ``moe``'s
    gate/up or down stack: the 4-bit codes, scales and zeros as they are where the stack is W4 (groups of 32,
    fractional zeros kept: the MoE kernels subtract them in fp32), else dequantized once into the dense stack
    (8-bit types such as a Q4_K_M file's Q6_K down experts). Returns how it was loaded.

    Raises:
        ValueError: a shape that does not fit the layer, or NaN/inf block scales (naming the tensor).
    """
    part = leaf[: -len(STACKED_SUFFIX)]
    stack = "w2" if part == "down" else "w13"
    inter = moe.intermediate_size
    rows = slice(None) if part == "down" else slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
    e, n, k = t.shape
    want = (moe.num_experts, moe.hidden_size if part == "down" else inter, inter if part == "down" else moe.hidden_size)
    if (e, n, k) != want:
        raise ValueError(f"{gf.path}: tensor {t.gguf_name} has shape {(e, n, k)}, the model expects {want}")
    if moe.is_quantized(stack) and fmt.kind == "w4":
        gc = _codes(gf, t)
        if gc.group_size != moe.group_sizes[stack]:
            raise ValueError(f"{gf.path}: tensor {t.gguf_name} has groups of {gc.group_size}, the stack "
                             f"{moe.group_sizes[stack]}")
        zero = gc.zero if gc.zero is not None else np.zeros_like(gc.scale)
        dtype = getattr(moe, f"{stack}_scales").dtype
        getattr(moe, f"{stack}_qweight")[:, rows] = pack_codes_w4(gc.codes).view(e, n, k // 8)
        for buf, values in (("scales", gc.scale), ("zeros", zero)):  # [E * N, K // G] -> [E, K // G, N]
            target = getattr(moe, f"{stack}_{buf}")
            target[:, :, rows] = torch.from_numpy(values).view(e, n, -1).transpose(1, 2).to(dtype)
        moe.weights_changed()
        return fmt.describe()
    getattr(moe, f"{stack}_weight")[:, rows] = gf.dequantize(t.hf_name).to(getattr(moe, f"{stack}_weight").dtype)
    moe.weights_changed()
    return f"dense ({fmt.source})"


def _replace(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    return new


def _swap_table(model: nn.Module, module_name: str, module: nn.Module, gf: GGUFFile, t: GGUFTensor,
                fmt: LinearFormat, device: torch.device, fractional_w4_ok: bool, tied: bool,
                report: dict[str, str]) -> None:
    """Replace a ``VocabEmbedding`` / ``LMHead`` by its quantized twin over a table loaded from ``t``."""
    dtype = module.weight.dtype
    table, text = _table(gf, t, fmt, device, dtype, fractional_w4_ok)
    if isinstance(module, VocabEmbedding):
        _replace(model, module_name, QuantizedVocabEmbedding(table, dtype))
        report[module_name] = text
        if tied and getattr(model, "lm_head", None) is not None:  # a pooling engine's model has no head
            model.lm_head = QuantizedLMHead(table)
            report["lm_head"] = f"tied to embed_tokens: {text}"
    else:
        _replace(model, module_name, QuantizedLMHead(table))
        report[module_name] = text
