"""The Triton kernels against their plain-PyTorch twins on a CUDA GPU at real model shapes.

Skipped without CUDA, and under ``TRITON_INTERPRET=1`` (the interpreter at these shapes would
take hours): run as ``pytest tests/gpu/test_kernels_gpu.py`` with the variable unset.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1", reason="real shapes: not under the interpreter"),
]

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    from lightinfer.kernels import PagedKV, SplitKPartials, switches
    from lightinfer.kernels import norm_rope as nr
    from lightinfer.kernels import reference as ref
    from lightinfer.kernels import w4a16_gemm as wg
    from lightinfer.kernels.kv_store import store_kvcache
    from lightinfer.kernels.paged_attention import (
        paged_attention_decode,
        paged_attention_decode_impl,
        paged_attention_prefill,
    )

DEV = "cuda"
# (K, N) of Llama-2-7B and Llama-3-8B linears: qkv, o, gate_up, down
LINEAR_SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096),
                 (4096, 6144), (4096, 28672), (14336, 4096)]


def _int8_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> PagedKV:
    """A zeroed INT8 cache on the GPU (scales and zeros contiguous)."""
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8, device=DEV)
    aux = [torch.zeros(num_blocks, block_size, num_kv_heads, dtype=torch.float16, device=DEV) for _ in range(4)]
    return PagedKV(kc, torch.zeros_like(kc), *aux)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _weights(n: int, k: int, g: int, dtype: torch.dtype = torch.float16, fractional: bool = False):
    """Random W4 weights; ``fractional``: zero points as GGUF Q4_1 / Q4_K have them (-m / d, not integers)."""
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=DEV, dtype=torch.int32)
    scales = (torch.rand(k // g, n, generator=gen, device=DEV) * 0.01 + 0.001).to(dtype)
    if fractional:
        zeros = (torch.rand(k // g, n, generator=gen, device=DEV) * 20 - 2).to(dtype)
    else:
        zeros = torch.randint(0, 16, (k // g, n), generator=gen, device=DEV).to(dtype)
    return ref.pack_int4_rows(codes), scales, zeros


@pytest.mark.parametrize("k,n", LINEAR_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 100, 1024])
@pytest.mark.parametrize("zeros_kind", ["integer", "fractional"])
def test_w4a16_all_paths_real_shapes(k: int, n: int, m: int, zeros_kind: str) -> None:
    """Integer zeros with ``integer_zeros=True`` (fp16 pairs), fractional ones (GGUF Q4_1 / Q4_K) without it."""
    integer = zeros_kind == "integer"
    qweight, scales, zeros = _weights(n, k, 128, fractional=not integer)
    x = torch.randn(m, k, device=DEV, dtype=torch.float16)
    bias = torch.randn(n, device=DEV, dtype=torch.float16)
    want = ref.w4a16_gemm(x, qweight, scales, zeros, bias)
    paths = ["tiled", "swap_ab", "dequant"] + (["gemv"] if m <= 16 else [])
    for path in paths:
        got = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path=path, integer_zeros=integer)
        assert _rel_err(got, want) < 3e-3, (path, m, k, n)
    assert _rel_err(wg.w4a16_gemm(x, qweight, scales, zeros, bias, integer_zeros=integer), want) < 3e-3


# Fractions a rounding decode loses (1024 + z in fp16, 2^23 + z in fp32 keep none of them)
FRACTIONS = (0.0, 0.5, 0.25, 0.75, 0.125, 0.375, -0.5, -0.125)


@pytest.mark.parametrize("path", ["gemv", "tiled", "swap_ab", "dequant"])
@pytest.mark.parametrize("zeros_kind", ["integer", "fractional"])
def test_w4_decode_is_exact_on_the_gpu(path: str, zeros_kind: str) -> None:
    """On the GPU, every code at every nibble position and every zero point gives q - z exactly (one-hot x picks
    single weights), with and without split-K: integer zeros through the fp16 pair decode's PTX
    (w4_decode.F16_PAIR_DECODE_PTX; the GEMV's one FADD), fractional ones (x.5, x.25, ...) through the two-step
    fp32 decode."""
    integer = zeros_kind == "integer"
    n, k, g = 256, 256, 128
    rows, cols = torch.arange(n, device=DEV), torch.arange(k, device=DEV)
    codes = ((rows[:, None] // 16 + cols[None, :]) % 16).int()
    qweight = ref.pack_int4_rows(codes)
    scales = torch.ones(k // g, n, dtype=torch.float16, device=DEV)
    frac = 0.0 if integer else torch.tensor(FRACTIONS, device=DEV)[(rows // 16) % len(FRACTIONS)]
    zeros = ((rows % 16).float() + frac).half()[None, :].repeat(k // g, 1)
    m = 1 if path == "gemv" else 5
    for k0 in range(8):
        x = torch.zeros(m, k, dtype=torch.float16, device=DEV)
        x[:, k0] = 1.0
        x[:, g + k0 + 8] = 2.0
        exact = ((codes[:, k0] - zeros[0].float()) + 2 * (codes[:, g + k0 + 8] - zeros[0].float())).half()
        for split_k in (1, 2):
            got = wg.w4a16_gemm_path(x, qweight, scales, zeros, path=path, split_k=split_k, integer_zeros=integer)
            assert torch.equal(got, exact.expand(m, n)), (path, k0, split_k)


def test_fractional_zeros_dequantize_to_the_reference_bits() -> None:
    """The dequant kernel with fractional zeros gives exactly the reference dequantization (fp32 q - z and scale,
    one rounding to fp16): nothing of the zero point rounded before the weight itself."""
    qweight, scales, zeros = _weights(4096, 4096, 128, fractional=True)
    assert torch.equal(wg.dequantize_w4(qweight, scales, zeros, torch.float16), ref.dequantize_w4(qweight, scales, zeros))


def test_f16_pair_decode_same_bits_as_fp32_decode() -> None:
    """With real fp16 scales (subnormal ones too) the pair decode's scaled tiles (scale_rows: tiled above 32 rows,
    swap_ab above 64 tokens, dequant) give the same bits as the fp32 decode (LIGHTINFER_F16_DECODE=0)."""
    qweight, scales, zeros = _weights(4096, 4096, 128)
    scales[0, :64] = torch.tensor(2.0**-20, dtype=torch.float16)  # subnormal scales on the first rows
    x = torch.randn(200, 4096, device=DEV, dtype=torch.float16)
    launches = [wg.W4Launch("tiled", 64, 128, 64, 4, 3), wg.W4Launch("swap_ab", 128, 128, 64, 8, 3),
                wg.W4Launch("dequant")]
    pair = [wg.w4a16_gemm_path(x, qweight, scales, zeros, launch=la, integer_zeros=True) for la in launches]
    with switches.override(f16_decode=False):
        for la, got in zip(launches, pair):
            assert torch.equal(wg.w4a16_gemm_path(x, qweight, scales, zeros, launch=la, integer_zeros=True), got), la
    for la, got in zip(launches, pair):  # zeros not promised integers: the two-step fp32 decode, the same bits
        assert torch.equal(wg.w4a16_gemm_path(x, qweight, scales, zeros, launch=la), got), la


def test_deferred_split_k_into_norm_and_silu_real_shapes() -> None:
    """o/down GEMM partials into the fused add + norm, gate_up partials into SiLU: identical to reducing first."""
    with switches.override(w4a16_configs="none"):  # the built-in launch splits K at M=1; a tuned one may not
        _deferred_split_k_into_norm_and_silu()


def _deferred_split_k_into_norm_and_silu() -> None:
    for k, n in ((4096, 4096), (4096, 28672)):
        qweight, scales, zeros = _weights(n, k, 128)
        x = torch.randn(1, k, device=DEV, dtype=torch.float16)
        parts = wg.w4a16_gemm(x, qweight, scales, zeros, defer_reduce=True, integer_zeros=True)
        assert not isinstance(parts, torch.Tensor)  # M=1 splits K on this GPU
        y = wg.w4a16_gemm(x, qweight, scales, zeros, integer_zeros=True)
        assert torch.equal(parts.reduced(), y)
        if n == 4096:
            r, w = torch.randn(1, n, device=DEV, dtype=torch.float16), torch.rand(n, device=DEV, dtype=torch.float16)
            got, want = nr.fused_add_rms_norm(parts, r, w, 1e-5), nr.fused_add_rms_norm(y, r, w, 1e-5)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert torch.equal(nr.silu_and_mul(parts), nr.silu_and_mul(y))


def test_tuned_launches_of_this_gpu_are_correct() -> None:
    """Every launch in this GPU's kernels/configs/w4a16_<device>.json (bench/kernels/tune_w4a16.py) against the
    reference, at its own shape and M, with a bias (the tuner timed without one), for integer zeros (what it
    timed) and fractional ones (the same launch, the exact decode)."""
    from lightinfer.kernels import w4a16_tuning as wt

    path = wt.device_file(torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no tuned file for this GPU ({path.name})")
    for key, rows in wt.parse_file(path).items():
        n, k, g = (int(v.split("=")[1]) for v in key.split(","))
        bias = torch.randn(n, device=DEV, dtype=torch.float16)
        for integer in (True, False):
            qweight, scales, zeros = _weights(n, k, g, fractional=not integer)
            for m, launch in rows:
                x = torch.randn(m, k, device=DEV, dtype=torch.float16)
                assert wg.choose_launch(m, n, k, g, x.device) == launch
                got = wg.w4a16_gemm(x, qweight, scales, zeros, bias, integer_zeros=integer)
                assert _rel_err(got, ref.w4a16_gemm(x, qweight, scales, zeros, bias)) < 3e-3, (key, m, launch, integer)


def test_w4a16_pre_hopper_tiles_on_this_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles chosen for sm_80/86/89 (64-row tile at 8 warps) are correct here too."""
    monkeypatch.setattr(wg, "tiled_configs", lambda device: wg.TILED_CONFIGS_PRE_HOPPER)
    for integer in (True, False):
        qweight, scales, zeros = _weights(4096, 4096, 128, fractional=not integer)
        for m in (20, 40, 64):
            x = torch.randn(m, 4096, device=DEV, dtype=torch.float16)
            got = wg.w4a16_gemm_path(x, qweight, scales, zeros, path="tiled", integer_zeros=integer)
            assert _rel_err(got, ref.w4a16_gemm(x, qweight, scales, zeros)) < 3e-3, (m, integer)


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("n", [200, 4104])  # N = 8 * odd
def test_w4a16_small_groups_ragged_n_bf16(g: int, n: int) -> None:
    qweight, scales, zeros = _weights(n, 2048, g, torch.bfloat16)
    for m in (1, 5, 64):
        x = torch.randn(m, 2048, device=DEV, dtype=torch.bfloat16)
        want = ref.w4a16_gemm(x, qweight, scales, zeros)
        for path in ("gemv", "tiled", "dequant") if m <= 16 else ("tiled", "dequant"):
            assert _rel_err(wg.w4a16_gemm_path(x, qweight, scales, zeros, path=path), want) < 1e-2, (path, m)


def _paged(ctx: list[int], num_kv_heads: int, head_dim: int, block_size: int, int8: bool):
    """Random K/V for each sequence stored (by our kernel) into shuffled blocks of a new cache: returns the
    :class:`PagedKV`, the block table, the lengths and the dense K/V."""
    nblk = [(c + block_size - 1) // block_size for c in ctx]
    num_blocks = sum(nblk) + 8
    perm = torch.randperm(num_blocks, device=DEV)
    table = torch.full((len(ctx), max(nblk) + 1), -1, dtype=torch.int32, device=DEV)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.zeros(shape, dtype=torch.int8 if int8 else torch.float16, device=DEV)
    vc = torch.zeros_like(kc)
    aux = [torch.zeros(shape[:3], dtype=torch.float16, device=DEV) for _ in range(4)] if int8 else [None] * 4
    kv = PagedKV(kc, vc, *aux)
    dense = []
    used = 0
    for s, (n, nb) in enumerate(zip(ctx, nblk)):
        table[s, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(n, device=DEV)
        slots = table[s, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, num_kv_heads, head_dim, device=DEV, dtype=torch.float16)
        v = torch.randn(n, num_kv_heads, head_dim, device=DEV, dtype=torch.float16)
        store_kvcache(k, v, kv, slots)
        dense.append((k, v))
    return kv, table, torch.tensor(ctx, dtype=torch.int32, device=DEV), dense


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8), (64, 8)])
def test_decode_real_shapes(int8: bool, num_heads: int, num_kv_heads: int) -> None:
    ctx = [1, 15, 16, 17, 511, 512, 513, 4000]
    kv, table, lens, _ = _paged(ctx, num_kv_heads, 128, 16, int8)
    q = torch.randn(len(ctx), num_heads, 128, device=DEV, dtype=torch.float16)
    want = ref.paged_attention_decode(q, kv, table, lens, 128**-0.5)
    assert _rel_err(paged_attention_decode(q, kv, table, lens, 128**-0.5), want) < 2e-3
    one = paged_attention_decode_impl(q, kv, table, lens, 128**-0.5, partition_size=8192)
    assert _rel_err(one, want) < 2e-3


def test_int8_head_major_scales_real_shapes() -> None:
    """The engine's GPU layout of the INT8 scales (head-major: a head's tokens 1 apart, which Triton
    compiles as a constant stride) gives the same decode and prefill as the contiguous layout."""
    ctx = [1, 17, 513, 4000]
    kv, table, lens, _ = _paged(ctx, 8, 128, 16, True)
    hm = PagedKV(kv.k, kv.v, *[t.transpose(1, 2).contiguous().transpose(1, 2) for t in kv.scales])
    assert hm.k_scale.stride(1) == 1
    q = torch.randn(len(ctx), 32, 128, device=DEV, dtype=torch.float16)
    want = ref.paged_attention_decode(q, kv, table, lens, 128**-0.5)
    assert _rel_err(paged_attention_decode(q, hm, table, lens, 128**-0.5), want) < 2e-3
    cu = torch.tensor([0, 1, 18, 531, 4531], dtype=torch.int32, device=DEV)
    qp = torch.randn(4531, 32, 128, device=DEV, dtype=torch.float16)
    want = ref.paged_attention_prefill(qp, kv, cu, lens, table, 128**-0.5)
    assert _rel_err(paged_attention_prefill(qp, hm, cu, lens, table, 128**-0.5), want) < 2e-3


@pytest.mark.parametrize("int8", [False, True])
def test_prefill_real_shapes(int8: bool) -> None:
    q_lens, prefix = [1, 300, 1000, 37], [0, 64, 500, 1]
    ctx = [p + n for p, n in zip(prefix, q_lens)]
    kv, table, lens, _ = _paged(ctx, 8, 128, 16, int8)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), 32, 128, device=DEV, dtype=torch.float16)
    want = ref.paged_attention_prefill(q, kv, cu, lens, table, 128**-0.5)
    assert _rel_err(paged_attention_prefill(q, kv, cu, lens, table, 128**-0.5), want) < 2e-3


def test_int8_kv_round_trip_error_bound() -> None:
    ctx = [2048, 777]
    kv, table, lens, dense = _paged(ctx, 8, 128, 16, True)
    for s, (k, v) in enumerate(dense):
        pos = torch.arange(ctx[s], device=DEV)
        blk, off = table[s, pos // 16].long(), pos % 16
        for back, scale, x in zip(ref.gather_kv(kv, table[s], ctx[s], torch.float32), (kv.k_scale, kv.v_scale), (k, v)):
            sc = scale[blk, off].float().unsqueeze(-1)
            # half a quantization step + fp16 rounding of the stored zero point
            bound = sc / 2 + x.float().abs().amax(-1, keepdim=True) * 2**-10 + 1e-6
            assert ((back - x.float()).abs() <= bound).all()
    # end to end: attention over the int8 cache stays close to attention over the fp16 values
    q = torch.randn(2, 32, 128, device=DEV, dtype=torch.float16)
    fp = torch.stack([ref.attend(q[i:i + 1], k, v, 128**-0.5, ctx[i] - 1)[0] for i, (k, v) in enumerate(dense)])
    assert _rel_err(paged_attention_decode(q, kv, table, lens, 128**-0.5), fp) < 2e-2


def test_kv_store_matches_reference_bitwise() -> None:
    t, h, d, bs = 4096, 8, 128, 16
    key = torch.randn(t, h, d, device=DEV, dtype=torch.float16) * 3
    value = torch.randn(t, h, d, device=DEV, dtype=torch.float16)
    slots = torch.randperm(512 * bs, device=DEV)[:t]
    slots[::97] = -1
    out = []
    for fn in (ref.store_kvcache, store_kvcache):
        cache = _int8_cache(512, bs, h, d)
        fn(key, value, cache, slots)
        out.append(cache.tensors())
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_norm_rope_act_real_shapes() -> None:
    x = torch.randn(512, 4096, device=DEV, dtype=torch.float16)
    r = torch.randn(512, 4096, device=DEV, dtype=torch.float16)
    w = torch.rand(4096, device=DEV, dtype=torch.float16)
    assert _rel_err(nr.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) < 1e-3
    o, res = nr.fused_add_rms_norm(x, r, w, 1e-5)
    o2, res2 = ref.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, res2) and _rel_err(o, o2) < 1e-3
    pos = torch.randint(0, 8192, (512,), device=DEV)
    tables = (torch.randn(8192, 64, device=DEV), torch.randn(8192, 64, device=DEV))
    q = torch.randn(512, 32, 128, device=DEV, dtype=torch.bfloat16)
    for got, want in zip(nr.rotary_qk(pos, q, q, *tables), ref.rotary_qk(pos, q, q, *tables)):
        assert _rel_err(got, want) < 5e-3
    qkv = torch.randn(512, 48 * 128, device=DEV, dtype=torch.float16)  # Llama-3-8B: 32 q + 8 k + 8 v heads
    qh, kh = qkv[:, :4096].view(512, 32, 128), qkv[:, 4096:5120].view(512, 8, 128)
    for got, want in zip(nr.rotary_qk(pos, qh, kh, *tables), ref.rotary_qk(pos, qh, kh, *tables)):
        assert _rel_err(got, want) < 1e-3
    y = torch.randn(512, 2 * 14336, device=DEV, dtype=torch.float16)
    assert _rel_err(nr.silu_and_mul(y), ref.silu_and_mul(y)) < 1e-3


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8)])  # Llama-2-7B, Llama-3-8B
def test_rope_store_real_shapes(num_heads: int, num_kv_heads: int) -> None:
    # The fused qkv epilogue (split-K partials + bias -> RoPE -> INT8 KV store) against the unfused
    # reference sequence: q to rounding, the cache codes within one step of the quantizer's grid.
    from lightinfer.kernels.rope_store import rope_store_kvcache

    t, d, bs = 64, 128, 16
    width = (num_heads + 2 * num_kv_heads) * d
    qkv = SplitKPartials(torch.randn(6, t, width, device=DEV), torch.randn(width, device=DEV).half(), torch.float16)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    tables = (torch.randn(8192, d // 2, device=DEV), torch.randn(8192, d // 2, device=DEV))
    slots = torch.randperm(64 * bs, device=DEV)[:t]
    slots[::7] = -1
    out = []
    for fn in (ref.rope_store_kvcache, rope_store_kvcache):
        cache = _int8_cache(64, bs, num_kv_heads, d)
        q = fn(pos, qkv, num_heads, num_kv_heads, *tables, cache, slots)
        out.append((q, *cache.tensors()))
    (q_ref, *cache_ref), (q_got, *cache_got) = out
    assert _rel_err(q_got, q_ref) < 1e-3
    for got, want in zip(cache_got[:2], cache_ref[:2]):
        assert (got.int() - want.int()).abs().max() <= 1
    for got, want in zip(cache_got[2:], cache_ref[2:]):
        assert _rel_err(got, want) < 1e-3


def test_pdl_chain_matches_plain_launches() -> None:
    """A decode-like chain (split-K GEMV -> fused add + RMSNorm on its partials -> GEMV -> SiLU-mul), eager and
    replayed in a CUDA graph, gives the same bits with programmatic dependent launch on and off."""
    from lightinfer.kernels import pdl

    qw1, s1, z1 = _weights(2 * 4096, 4096, 128)
    qw2, s2, z2 = _weights(4096, 4096, 128)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.float16)
    res = torch.randn(1, 4096, device=DEV, dtype=torch.float16)
    w = torch.rand(4096, device=DEV, dtype=torch.float16)

    def chain() -> torch.Tensor:
        h, r = nr.fused_add_rms_norm(wg.w4a16_gemm(x, qw2, s2, z2, defer_reduce=True, integer_zeros=True), res, w,
                                     1e-5)
        return nr.silu_and_mul(wg.w4a16_gemm(h, qw1, s1, z1, defer_reduce=True, integer_zeros=True)) + r.sum()

    results = {}
    for flag in ("0", "1"):
        with switches.override(pdl=flag == "1"):  # the launches (and the graph's capture) read it
            eager = chain()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                chain()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                replayed = chain()
            graph.replay()
            torch.cuda.synchronize()
            results[flag] = (eager, replayed.clone())
            if flag == "1" and torch.cuda.get_device_capability()[0] >= 9:
                assert pdl.pdl_enabled(torch.device(DEV))
    assert torch.equal(results["0"][0], results["1"][0]) and torch.equal(results["0"][1], results["1"][1])
    assert torch.equal(results["1"][0], results["1"][1])
