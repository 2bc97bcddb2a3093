"""The ``torch_cpu`` backend's small per-layer ops in as few torch calls as possible.

On a CPU at batch 1 a decoder layer's four GEMMs take ~100 us and every other op costs its dispatch
(1-5 us each, more for torch's composite kernels: ``F.rms_norm`` is ~25 us for 576 values, a chain of
pow / mean / rsqrt / mul). So each op here is the fewest dispatches that give the reference's result
(``reference.py``, up to fp32 summation order), and whatever is the same for every layer of a step is
computed once per step (:class:`StepMemo`):

* RMSNorm is torch's fused LayerNorm over ``[x, -x]``: its mean is 0, so its variance is ``mean(x^2)``
  and it normalises by exactly the RMS (eps included), 3 calls instead of ~8;
* RoPE rotates q and k together, ``x * cos2 + roll(x, D/2) * sin2`` with ``cos2 = [cos, cos]`` and
  ``sin2 = [-sin, sin]`` gathered at the step's positions once per step (not once per layer);
* the KV store is one ``index_copy_`` per cache tensor, the slots checked once per step;
* SiLU·mul computes in fp32 and rounds once into the output dtype, as the reference does.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from . import cpu_native
from .paged_kv import PagedKV
from .reference import qk_heads, quantize_kv_int8
from .split_k import SplitKPartials
from .step_memo import step_memo

# RMSNorm weights doubled for the LayerNorm form, one per weight tensor (dropped with the weight).
_doubled: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _doubled_weight(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    hit = _doubled.get(key)
    version = -1 if weight.is_inference() else weight._version
    if hit is not None and hit[0]() is weight and hit[1] == version:
        return hit[2]
    doubled = torch.cat([weight, weight]).to(torch.float32)
    _doubled[key] = (weakref.ref(weight, lambda _, k=key: _doubled.pop(k, None)), version, doubled)
    return doubled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, returned in ``x.dtype`` (module docstring: LayerNorm of
    ``[x, -x]``, whose variance is ``mean(x^2)``)."""
    native = cpu_native.add_rms_norm(None, x, weight, eps)
    if native is not None:
        return native[0]
    h = x.shape[-1]
    # an fp32 weight with 16-bit x: torch's mixed-dtype LayerNorm applies it in fp32 and rounds once
    return F.layer_norm(torch.cat([x, x.neg()], dim=-1), (2 * h,), _doubled_weight(weight), None, eps)[..., :h]


def qk_rms_norm_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float) -> bool:
    """``reference.qk_rms_norm_``: the C op in place where it applies (one call per layer, which a recorded decode
    step replays), else the heads normalized as :func:`rms_norm` does. Always True."""
    if cpu_native.qk_norm_(qkv, num_heads, num_kv_heads, q_weight, k_weight, eps):
        return True
    q, k = qk_heads(qkv, num_heads, num_kv_heads, q_weight.shape[-1])
    q.copy_(rms_norm(q.contiguous(), q_weight, eps))
    k.copy_(rms_norm(k.contiguous(), k_weight, eps))
    return True


def fused_add_rms_norm(x: torch.Tensor | SplitKPartials, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in ``x.dtype``); returns ``(rms_norm(residual), residual)``."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    native = cpu_native.add_rms_norm(x, residual, weight, eps)
    if native is not None:
        return native
    residual = x + residual if residual.dtype == x.dtype else (x.to(torch.float32) + residual).to(x.dtype)
    return rms_norm(residual, weight, eps), residual


def _rope_tables(positions: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos2, sin2)`` fp32 ``[T, 1, D]`` at ``positions`` (module docstring), once per step."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_cache[positions].to(torch.float32), sin_cache[positions].to(torch.float32)
        return torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin.neg(), sin], -1).unsqueeze(1)
    return step_memo.get("rope", (positions, cos_cache, sin_cache), (), build)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first ``R = cos2.shape[-1]`` dims of ``x [T, H, D]`` (any strides), in fp32: the
    reference's products and sums, each rounded as there (``addcmul`` would fuse a multiply-add and round
    differently). ``R < D``: partial rotation (Phi-3, ``partial_rotary_factor``), the other dims pass as they are."""
    r = cos2.shape[-1]
    if r == x.shape[-1]:
        return x * cos2 + x.roll(r // 2, dims=-1) * sin2
    head = x[..., :r]
    return torch.cat([head * cos2 + head.roll(r // 2, dims=-1) * sin2, x[..., r:].to(torch.float32)], dim=-1)


def rotary_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
              sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.rotary_qk``: q ``[T, Hq, D]`` and k ``[T, Hk, D]`` rotated at ``positions [T]``."""
    cos2, sin2 = _rope_tables(positions, cos_cache, sin_cache)
    return _rotate(q, cos2, sin2).to(q.dtype), _rotate(k, cos2, sin2).to(k.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``reference.apply_rotary``: ``x [T, H, D]`` with cos/sin ``[T, R // 2]`` (R <= D) already gathered."""
    cos2 = torch.cat([cos, cos], -1).to(torch.float32).unsqueeze(1)
    sin2 = torch.cat([sin.neg(), sin], -1).to(torch.float32).unsqueeze(1)
    return _rotate(x, cos2, sin2).to(x.dtype)


def _valid_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(int64 slots to write, row indices of those tokens or None when all are kept)``, once per step."""
    def build() -> tuple[torch.Tensor, torch.Tensor | None]:
        keep = slot_mapping >= 0
        if bool(keep.all()):
            return slot_mapping.long(), None
        rows = keep.nonzero().flatten()
        return slot_mapping[rows].long(), rows
    return step_memo.get("slots", (slot_mapping,), (), build)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping [T]`` (-1: padding, skipped),
    quantizing for an INT8 cache (``reference.store_kvcache``'s result)."""
    slots, rows = _valid_slots(slot_mapping)
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    if slots.numel() == 0:
        return
    flat = kv.num_blocks * kv.block_size
    if not kv.is_int8:
        kv.k.view(flat, *kv.k.shape[2:]).index_copy_(0, slots, key.to(kv.dtype))
        kv.v.view(flat, *kv.v.shape[2:]).index_copy_(0, slots, value.to(kv.dtype))
        return
    heads = key.shape[1]
    codes, scale, zero = quantize_kv_int8(torch.cat([key, value], dim=1))  # K and V heads in one pass
    kv.k.view(flat, *kv.k.shape[2:]).index_copy_(0, slots, codes[:, :heads])
    kv.v.view(flat, *kv.v.shape[2:]).index_copy_(0, slots, codes[:, heads:])
    for t, x in zip(kv.scales, (scale[:, :heads], zero[:, :heads], scale[:, heads:], zero[:, heads:])):
        if t.is_contiguous():  # the CPU layout: one flat row per slot
            t.view(flat, t.shape[-1]).index_copy_(0, slots, x)
        else:  # e.g. the head-major scales KVCacheSpec allocates on a GPU
            t[slots // kv.block_size, slots % kv.block_size] = x


def rope_store_kvcache(positions: torch.Tensor, qkv: torch.Tensor | SplitKPartials, num_heads: int,
                       num_kv_heads: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor, kv: PagedKV,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """A fused qkv projection's output ``[T, (Hq + 2 Hk) D]``: q and k rotated together, k and v written at
    ``slot_mapping``; returns q ``[T, Hq, D]`` in ``qkv.dtype`` (``reference.rope_store_kvcache``)."""
    if isinstance(qkv, SplitKPartials):
        qkv = qkv.reduced()
    native = cpu_native.rope_store(positions, qkv, num_heads, num_kv_heads, cos_cache, sin_cache, kv, slot_mapping)
    if native is not None:
        return native
    d = kv.head_dim  # the rotated dims may be fewer (partial rotary)
    cos2, sin2 = _rope_tables(positions, cos_cache, sin_cache)
    qk = _rotate(qkv[:, : (num_heads + num_kv_heads) * d].unflatten(-1, (num_heads + num_kv_heads, d)),
                 cos2, sin2).to(qkv.dtype)  # rounded as the reference rounds q and k
    v = qkv[:, (num_heads + num_kv_heads) * d:].unflatten(-1, (num_kv_heads, d))
    store_kvcache(qk[:, num_heads:], v, kv, slot_mapping)
    return qk[:, :num_heads]


def silu_and_mul(x: torch.Tensor | SplitKPartials) -> torch.Tensor:
    """``x [..., 2 I]`` -> ``silu(x[..., :I]) * x[..., I:]``, computed in fp32 and rounded once into ``x.dtype``."""
    if isinstance(x, SplitKPartials):
        x = x.reduced()
    native = cpu_native.silu_mul(x)
    if native is not None:
        return native
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    if x.dtype == torch.float32:
        return F.silu(gate) * up
    out = torch.empty(up.shape, dtype=x.dtype, device=x.device)
    return torch.mul(F.silu(gate.to(torch.float32)), up, out=out)
