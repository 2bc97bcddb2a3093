"""Every (kernel, constexprs, num_warps, num_stages) the launchers can start, as :class:`LaunchSpec` rows.

Built from the launcher modules' own configuration tables (``GEMV_CONFIGS``, ``DECODE_CONFIGS``, ...), so
a configuration added there is compiled by the audits (``smem_check``, ``sass_stats``, ``pdl_check``)
without a change here; the shapes below only pick which head counts, head sizes and hidden sizes to
compile them at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import kv_store, norm_rope, paged_attention, rope_store, w4a16_gemm, w8a16_gemm
from ..launch_utils import TRITON_DTYPE, next_pow2
from ..paged_kv import KV_BLOCK_SIZES
from ..w4a16_tiled import w4a16_tiled_kernel

ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_GQA_GROUPS = (1, 4, 8)
STORE_HEAD_DIMS = (64, 128)  # the store launcher takes any
STORE_NUM_KV_HEADS = (1, 8, 32)
NORM_HIDDEN_SIZES = (576, 4096, 8192, 14336)  # any size up to norm_rope.MAX_HIDDEN runs
ROPE_STORE_SHAPES = ((32, 32, 128), (32, 8, 128), (28, 4, 128), (9, 3, 64))  # (heads, kv heads, head_dim)


@dataclass(frozen=True)
class LaunchSpec:
    """One compiled variant of a kernel: what ``triton.compile(ASTSource(...))`` needs.

    ``signature`` maps every argument name to a Triton type string (``"*fp16"``, ``"i32"``,
    ``"constexpr"``); ``constexprs`` gives the value of each ``constexpr`` argument.
    """

    name: str
    kernel: Any  # the @triton.jit function (a JITFunction when not interpreting)
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    tags: dict[str, Any] = field(default_factory=dict)


def _spec(name: str, kernel: Any, sig: dict[str, str], ce: dict[str, Any], num_warps: int,
          num_stages: int = 1) -> LaunchSpec:
    return LaunchSpec(name, kernel, {**sig, **dict.fromkeys(ce, "constexpr")}, ce, num_warps, num_stages)


def w4a16_specs(dtypes: tuple[torch.dtype, ...] = (torch.float16,)) -> list[LaunchSpec]:
    """Every W4A16 kernel variant the launcher can start (per activation dtype), for integer zero points (AWQ,
    GPTQ, ...: ``INTEGER_ZEROS=True``, the fp16 pair decode) and then for fractional ones (GGUF Q4_1 / Q4_K)."""
    wg = w4a16_gemm
    specs: list[LaunchSpec] = []
    for dt, integer_zeros in [(dt, iz) for iz in (True, False) for dt in dtypes]:
        f = "*" + TRITON_DTYPE[dt]
        base = {"x_ptr": f, "qw_ptr": "*i32", "s_ptr": f, "z_ptr": f, "bias_ptr": f}
        ints = ["M", "N", "stride_xm", "stride_qn", "stride_sg", "stride_ym", "stride_ys"]
        for cfg in wg.GEMV_CONFIGS:
            for block_m in sorted({next_pow2(m) for m in range(1, wg.GEMV_MAX_M + 1)}):
                for split in (False, True):
                    sig = {**base, "y_ptr": "*fp32" if split else f, **{i: "i32" for i in ints},
                           "num_groups": "i32", "groups_per_split": "i32", "nibble_mask": "i32"}
                    ce = {"GROUP_SIZE": cfg.group_size, "BLOCK_M": block_m, "BLOCK_N": cfg.rows(block_m),
                          "NUM_STAGES": cfg.num_stages, "HAS_BIAS": True, "SPLIT": split,
                          "INTEGER_ZEROS": integer_zeros}
                    specs.append(_spec(f"w4a16_gemv[{dt}]", wg.w4a16_gemv_kernel, sig, ce, cfg.num_warps,
                                       cfg.num_stages))
        # The tiled path's configurations, and the swap_ab path's forced defaults (tuned files bring their own).
        tensor_core = [("w4a16_tiled", False, t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)
                       for t in dict.fromkeys(wg.TILED_CONFIGS + wg.TILED_CONFIGS_PRE_HOPPER)]
        for block_m in (16, 32, 64):
            la = wg.default_launch(block_m, 4096, 4096, 128, torch.device("cpu"), "swap_ab")
            tensor_core.append(("w4a16_swap_ab", True, la.block_m, la.block_n, la.block_k, la.num_warps, la.num_stages))
        for name, swap, block_m, block_n, block_k, num_warps, num_stages in tensor_core:
            for g in wg.SUPPORTED_GROUP_SIZES:
                for split in (False, True):
                    sig = {**base, "y_ptr": "*fp32" if split else f, **{i: "i32" for i in ints},
                           "num_k_steps": "i32", "steps_per_split": "i32", "nibble_mask": "i32"}
                    ce = {"GROUP_SIZE": g, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": min(block_k, g),
                          "HAS_BIAS": True, "SPLIT": split, "UPCAST_DOT": False, "SWAP_AB": swap,
                          **wg.f16_decode(dt, dt, ptx=True, integer_zeros=integer_zeros)}
                    specs.append(_spec(f"{name}[{dt}]", w4a16_tiled_kernel, sig, ce, num_warps, num_stages))
        for g in wg.SUPPORTED_GROUP_SIZES:
            ce = {"GROUP_SIZE": g, "BLOCK_N": wg.DEQUANT_BLOCK_N,
                  **wg.f16_decode(dt, dt, ptx=True, integer_zeros=integer_zeros)}
            sig = {"qw_ptr": "*i32", "s_ptr": f, "z_ptr": f, "w_ptr": f, "N": "i32", "K": "i32", "stride_qn": "i32",
                   "stride_sg": "i32", "stride_wn": "i32", "nibble_mask": "i32"}
            specs.append(_spec(f"w4_dequant[{dt}]", wg.w4_dequant_kernel, sig, ce, wg.DEQUANT_NUM_WARPS))
        if not integer_zeros:
            continue  # the split-K reduction does not see zero points
        ce = {"HAS_BIAS": True, "BLOCK_N": wg.REDUCE_BLOCK_N}
        sig = {"ws_ptr": "*fp32", "bias_ptr": f, "y_ptr": f, "N": "i32", "num_splits": "i32", "stride_ws": "i32",
               "stride_wm": "i32", "stride_ym": "i32"}
        specs.append(_spec(f"w4a16_split_k_reduce[{dt}]", wg.split_k_reduce_kernel, sig, ce, wg.REDUCE_NUM_WARPS))
    return specs


def attention_specs() -> list[LaunchSpec]:
    """Paged attention: fp16 queries, fp16 and int8 caches, head sizes, GQA groups; the engine's KV block sizes
    for int8 caches (their page gather's tile depends on it), 16 for fp16."""
    pa = paged_attention
    specs: list[LaunchSpec] = []
    cache_ints = ["stride_cb", "stride_co", "stride_ch", "stride_sb", "stride_so", "stride_sh"]
    for cache_dt in (torch.float16, torch.int8):
        c = "*" + TRITON_DTYPE[cache_dt]
        quant = cache_dt == torch.int8
        ptrs = {"kc_ptr": c, "vc_ptr": c, "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16"}
        for block_size in KV_BLOCK_SIZES if quant else (16,):
            for d in ATTN_HEAD_DIMS:
                dc = pa.attn_config(pa.DECODE_CONFIGS, d)
                for group in ATTN_GQA_GROUPS:
                    for split in (False, True):
                        ce = {"GROUP": group, "BLOCK_G": max(16, next_pow2(group)), "BLOCK_N": dc.block_n,
                              "BLOCK_D": d, "QUANT": quant, "SPLIT": split, "UPCAST_DOT": False,
                              "BLOCK_SIZE": block_size}
                        sig = {"q_ptr": "*fp16", **ptrs, "bt_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*fp16",
                               "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32",
                               **dict.fromkeys(["head_dim", "partition_size", "max_splits", "stride_qs", "stride_qh",
                                                "stride_os", "stride_oh", "stride_bts", *cache_ints], "i32")}
                        specs.append(_spec(f"attn_decode[{cache_dt}]", pa.paged_decode_kernel, sig, ce, dc.num_warps,
                                           dc.num_stages))
                pc = pa.attn_config(pa.PREFILL_INT8_CONFIGS if quant else pa.PREFILL_CONFIGS, d)
                ce = {"GROUP": 4, "BLOCK_M": pa.PREFILL_BLOCK_M, "BLOCK_N": pc.block_n, "BLOCK_D": d, "QUANT": quant,
                      "UPCAST_DOT": False, "BLOCK_SIZE": block_size}
                sig = {"q_ptr": "*fp16", **ptrs, "cu_ptr": "*i32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
                       "out_ptr": "*fp16", "qk_scale": "fp32",
                       **dict.fromkeys(["head_dim", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                        "stride_bts", *cache_ints], "i32")}
                specs.append(_spec(f"attn_prefill[{cache_dt}]", pa.paged_prefill_kernel, sig, ce, pc.num_warps,
                                   pc.num_stages))
    for d in ATTN_HEAD_DIMS:
        for bs in (2, 16, pa.MAX_DECODE_SPLITS):
            ce = {"BLOCK_S": bs, "BLOCK_D": d, "TILE": pa.attn_config(pa.DECODE_CONFIGS, d).block_n}
            sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "ctx_ptr": "*i32", "out_ptr": "*fp16",
                   **dict.fromkeys(["head_dim", "partition_size", "max_splits", "stride_os", "stride_oh"], "i32")}
            specs.append(_spec("attn_decode_reduce", pa.paged_decode_reduce_kernel, sig, ce, pa.REDUCE_NUM_WARPS))
    return specs


def kv_store_specs() -> list[LaunchSpec]:
    """The KV store: fp16 and int8 caches at common head counts and sizes."""
    specs = []
    ints = ["num_kv_heads", "head_dim", "block_size", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
            "stride_cb", "stride_co", "stride_ch", "stride_sb", "stride_so", "stride_sh"]
    for cache_dt in (torch.float16, torch.int8):
        c = "*" + TRITON_DTYPE[cache_dt]
        for h in STORE_NUM_KV_HEADS:
            for d in STORE_HEAD_DIMS:
                ce = {"QUANT": cache_dt == torch.int8, "BLOCK_H": h, "BLOCK_D": d}
                sig = {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": c, "vc_ptr": c, "slot_ptr": "*i64",
                       "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16",
                       **dict.fromkeys(ints, "i32")}
                specs.append(_spec(f"store_kv[{cache_dt}]", kv_store.store_kv_kernel, sig, ce, kv_store.NUM_WARPS))
    return specs


def norm_rope_specs() -> list[LaunchSpec]:
    """fp16 norms at common hidden sizes, rotary, SiLU."""
    nr = norm_rope
    specs = []
    for h in NORM_HIDDEN_SIZES:
        block = next_pow2(h)
        for res, splits in ((False, False), (True, False), (True, True)):  # split-K input: fused add only
            ce = {"HAS_RESIDUAL": res, "BLOCK": block, "SPLITS": splits, "SPLIT_BIAS": splits}
            sig = {**dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "xb_ptr"], "*fp16"),
                   **dict.fromkeys(["n_cols", "stride_x", "stride_r", "stride_o", "stride_ro", "stride_split",
                                    "num_splits"], "i32"), "eps": "fp32"}
            if splits:
                sig["x_ptr"] = "*fp32"
            specs.append(_spec("rms_norm", nr.rms_norm_kernel, sig, ce, nr.num_warps_for(block)))
    for hq, hk, d in ((32, 32, 128), (32, 8, 128), (9, 3, 64)):
        ce = {"BLOCK_HQ": next_pow2(hq), "BLOCK_HK": next_pow2(hk), "BLOCK_HALF": d // 2}
        sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
               "qo_ptr": "*fp16", "ko_ptr": "*fp16",
               **dict.fromkeys(["num_q_heads", "num_k_heads", "half", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                "stride_qot", "stride_qoh", "stride_kot", "stride_koh", "stride_cp", "stride_sp"], "i32")}
        specs.append(_spec("rotary_qk", nr.rotary_qk_kernel, sig, ce, nr.num_warps_for(ce["BLOCK_HQ"] * ce["BLOCK_HALF"])))
    for splits in (False, True):
        ce = {"BLOCK": nr.SILU_BLOCK, "SPLITS": splits, "SPLIT_BIAS": splits}
        sig = {"x_ptr": "*fp32" if splits else "*fp16", "out_ptr": "*fp16", "inter": "i32", "stride_x": "i32",
               "stride_o": "i32", "xb_ptr": "*fp16", "stride_split": "i32", "num_splits": "i32"}
        specs.append(_spec("silu_and_mul", nr.silu_and_mul_kernel, sig, ce, 4))
    return specs


def rope_store_specs() -> list[LaunchSpec]:
    """The fused RoPE + KV store: fp16 activations, fp16 and int8 caches, split-K input or not."""
    specs = []
    ints = ["stride_split", "num_splits", "num_heads", "num_kv_heads", "half", "block_size", "stride_xt", "stride_qt",
            "stride_qh", "stride_cp", "stride_sp", "stride_cb", "stride_co", "stride_ch", "stride_sb", "stride_so",
            "stride_sh"]
    for cache_dt in (torch.float16, torch.int8):
        c = "*" + TRITON_DTYPE[cache_dt]
        for hq, hk, d in ROPE_STORE_SHAPES:
            for splits in (False, True):
                ce = {"SPLITS": splits, "SPLIT_BIAS": splits, "QUANT": cache_dt == torch.int8,
                      "GROUP": hq // hk, "BLOCK_G": next_pow2(hq // hk), "BLOCK_HALF": d // 2}
                sig = {"x_ptr": "*fp32" if splits else "*fp16", "xb_ptr": "*fp16", "pos_ptr": "*i64",
                       "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*fp16", "kc_ptr": c, "vc_ptr": c,
                       "slot_ptr": "*i64", **dict.fromkeys(["ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr"], "*fp16"),
                       **dict.fromkeys(ints, "i32")}
                specs.append(_spec(f"rope_store[{cache_dt}]", rope_store.rope_store_kernel, sig, ce,
                                   rope_store.NUM_WARPS))
    return specs


def w8a16_specs(dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)) -> list[LaunchSpec]:
    """Every W8A16 kernel variant (per activation dtype, with and without zeros)."""
    specs: list[LaunchSpec] = []
    for dt in dtypes:
        f = "*" + TRITON_DTYPE[dt]
        sig = {"x_ptr": f, "q_ptr": "*i8", "s_ptr": "*fp32", "z_ptr": "*fp32", "bias_ptr": f, "y_ptr": f,
               **dict.fromkeys(("M", "N", "K", "G", "stride_xm", "stride_ym"), "i32")}
        for block_m, block_n, block_k, num_warps in w8a16_gemm.CONFIGS:
            for has_zero in (False, True):
                ce = {"HAS_ZERO": has_zero, "HAS_BIAS": True, "UPCAST_DOT": False,
                      "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
                specs.append(_spec(f"w8a16[{dt}]", w8a16_gemm.w8a16_kernel, sig, ce, num_warps))
    return specs


def all_launch_specs() -> list[LaunchSpec]:
    """Every :class:`LaunchSpec` of every launcher, in a fixed order (W4A16, attention, KV store, norms, RoPE store,
    W8A16)."""
    return [*w4a16_specs(), *attention_specs(), *kv_store_specs(), *norm_rope_specs(), *rope_store_specs(),
            *w8a16_specs()]
