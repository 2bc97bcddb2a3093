"""W4A16 GEMM (every path, integer and fractional zero points) against ``reference.w4a16_gemm`` under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import get_backend, switches
from lightinfer.kernels import reference as ref
from lightinfer.kernels import w4a16_gemm as wg


def _weights(n: int, k: int, g: int, dtype: torch.dtype, seed: int = 0, fractional: bool = False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    qweight = ref.pack_int4_rows(codes)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.002).to(dtype)
    if fractional:  # as GGUF Q4_1 / Q4_K: z = -m / d, anywhere (a negative m puts z above 0)
        zeros = (torch.rand(k // g, n, generator=gen) * 20 - 2).to(dtype)
        assert not bool(torch.equal(zeros, zeros.round()))
    else:
        zeros = torch.randint(0, 16, (k // g, n), generator=gen).to(dtype)
    return qweight, scales, zeros


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp16 output rounding ~5e-4 relative; the interpreter truncates fp32->bf16 (2 ulp ~ 1.6e-2).
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2},
            torch.bfloat16: {"atol": 5e-2, "rtol": 3e-2}}[dtype]


SHAPES = [  # (M, N, K, G): N = 8 * odd, M = 1 / not a multiple of any block / > 16
    (1, 72, 256, 32),
    (3, 200, 128, 64),
    (2, 8, 128, 128),
    (17, 72, 256, 128),
    (5, 200, 384, 128),
]


@pytest.mark.parametrize("path", ["gemv", "tiled", "swap_ab", "dequant"])
@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("zeros_kind", ["integer", "fractional"])
def test_paths_match_reference(path: str, m: int, n: int, k: int, g: int, dtype: torch.dtype, zeros_kind: str) -> None:
    """Integer zeros with the promise (``integer_zeros=True``: fp16 pairs for fp16), fractional ones without."""
    if path == "gemv" and m > 16:
        pytest.skip("gemv handles small M only")
    integer = zeros_kind == "integer"
    qweight, scales, zeros = _weights(n, k, g, dtype, fractional=not integer)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = ref.w4a16_gemm(x, qweight, scales, zeros, bias, integer_zeros=integer)
    for split_k in (1, 3):
        got = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path=path, split_k=split_k, integer_zeros=integer)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("integer", [True, False])
def test_public_launcher_auto_path_no_bias(m: int, integer: bool) -> None:
    qweight, scales, zeros = _weights(200, 256, 64, torch.float16, seed=m, fractional=not integer)
    x = torch.randn(m, 256).half()
    torch.testing.assert_close(wg.w4a16_gemm(x, qweight, scales, zeros, integer_zeros=integer).float(),
                               ref.w4a16_gemm(x, qweight, scales, zeros).float(), **_tol(torch.float16))


def test_bf16_and_strided_x() -> None:
    qweight, scales, zeros = _weights(72, 128, 32, torch.bfloat16)
    big = torch.randn(4, 256).bfloat16()
    x = big[:, :128]  # row stride 256: a view, not a copy
    for path in ("gemv", "tiled"):
        got = wg.w4a16_gemm_path(x, qweight, scales, zeros, path=path)
        torch.testing.assert_close(got.float(), ref.w4a16_gemm(x, qweight, scales, zeros).float(),
                                   **_tol(torch.bfloat16))


def test_awq_disk_layout_round_trip() -> None:
    # Independent oracle: dense W from the codes, AWQ disk tensors -> repack -> kernel.
    n, k, g = 72, 128, 32
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)  # [in, out]
    zcodes = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // g, n, generator=gen) * 0.05 + 0.01
    w = (codes - zcodes.repeat_interleave(g, 0)).float() * scales.repeat_interleave(g, 0)  # [K, N]
    qw, s, z = ref.repack_awq_to_runtime(ref.pack_awq(codes), ref.pack_awq(zcodes), scales, torch.float32)
    x = torch.randn(3, k, generator=gen)
    for path in ("gemv", "tiled", "dequant"):
        torch.testing.assert_close(wg.w4a16_gemm_path(x, qw, s, z, path=path), x @ w, atol=1e-4, rtol=1e-4)


# Fractions of a zero point that a rounding decode loses: 1024 + z in fp16 and 2^23 + z in fp32 keep none of them,
# 2^7 + z in fp32 (the nibble at bit 16) keeps all; (q - z) + 2 (q' - z) stays exact in fp16.
FRACTIONS = (0.0, 0.5, 0.25, 0.75, 0.125, 0.375, -0.5, -0.125)


def _one_hot_case(g: int, dtype: torch.dtype, fractional: bool):
    """Weights where row n has zero n % 16 (+ a fraction of :data:`FRACTIONS` by n // 16) and every code sits at
    every nibble position, with unit scales."""
    n, k = 256, 2 * g
    rows, cols = torch.arange(n), torch.arange(k)
    codes = ((rows[:, None] // 16 + cols[None, :]) % 16).int()  # row n: every code at every nibble
    qweight = ref.pack_int4_rows(codes)
    assert (qweight < 0).any()  # a code >= 8 in nibble 7 sets the sign bit
    scales = torch.ones(k // g, n, dtype=dtype)
    z = (rows % 16).float() + (torch.tensor(FRACTIONS)[(rows // 16) % len(FRACTIONS)] if fractional else 0.0)
    zeros = z.to(dtype)[None, :].repeat(k // g, 1)
    return codes, qweight, scales, zeros


def _one_hot_exact(path: str, g: int, dtype: torch.dtype, fractional: bool, integer_zeros: bool) -> list[tuple]:
    """The (k0, split_k) at which one-hot x (1 at k0, 2 at g + k0 + 8) does not give exactly
    (q - z) + 2 (q' - z): single weights decoded, at every nibble position, code and zero point."""
    codes, qweight, scales, zeros = _one_hot_case(g, dtype, fractional)
    m = 1 if path == "gemv" else 5
    wrong = []
    for k0 in range(8):
        x = torch.zeros(m, 2 * g, dtype=dtype)
        x[:, k0] = 1.0
        x[:, g + k0 + 8] = 2.0
        exact = ((codes[:, k0] - zeros[0].float()) + 2 * (codes[:, g + k0 + 8] - zeros[0].float())).to(dtype)
        for split_k in (1, 2):
            got = wg.w4a16_gemm_path(x, qweight, scales, zeros, path=path, split_k=split_k, integer_zeros=integer_zeros)
            if not torch.equal(got, exact.expand(m, 256)):
                wrong.append((k0, split_k))
    return wrong


@pytest.mark.parametrize("path", ["gemv", "tiled", "swap_ab", "dequant"])
@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("zeros_kind", ["integer", "fractional"])
def test_every_nibble_and_zero_point_decodes_exactly(path: str, g: int, dtype: torch.dtype, zeros_kind: str) -> None:
    """q - z is exact for every nibble position, code and zero point, with and without split-K: integer zeros
    with the promise (the exponent trick of ``unpack_minus_zero`` in one FADD; with fp16, the pair decode of
    ``unpack_minus_zero_f16``), fractional ones (x.5, x.25, ...) without it (the two-step fp32 decode)."""
    integer = zeros_kind == "integer"
    assert _one_hot_exact(path, g, dtype, fractional=not integer, integer_zeros=integer) == []


@pytest.mark.parametrize("path", ["gemv", "tiled", "dequant"])
def test_the_integer_decode_would_round_fractional_zeros(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test above guards against: the integer-zero decodes (fp16 pairs; the fp32 one FADD) given a
    fractional zero round it, so a launcher that picked them for GGUF Q4_1 / Q4_K weights would fail it."""
    monkeypatch.setattr(wg, "check_integer_zeros", lambda zeros: None)  # let the false promise through
    assert wg.f16_decode(torch.float16, integer_zeros=True)["F16_DECODE"]
    assert _one_hot_exact(path, 32, torch.float16, fractional=True, integer_zeros=True) != []
    assert _one_hot_exact(path, 32, torch.float32, fractional=True, integer_zeros=True) != []


def test_a_false_integer_zeros_promise_is_refused_on_cpu() -> None:
    """``integer_zeros=True`` with a fractional zero point: a clear error from the launcher (on the CPU, where
    checking is free) and from the reference backends, never a silently rounded result."""
    qweight, scales, zeros = _weights(16, 64, 32, torch.float16, fractional=True)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match="integer_zeros=False"):
        wg.w4a16_gemm(x, qweight, scales, zeros, integer_zeros=True)
    for backend in ("reference", "torch_cpu"):
        with pytest.raises(ValueError, match="integer_zeros=False"):
            get_backend(backend).w4a16_gemm(x.float(), qweight, scales, zeros, integer_zeros=True)
    zeros[0, 0] = 3.0  # integers or not, the unpromised call is exact
    assert wg.w4a16_gemm(x, qweight, scales, zeros).shape == (2, 16)


@pytest.mark.parametrize("path", ["gemv", "tiled", "swap_ab"])
def test_deferred_reduction_is_the_reduction(path: str) -> None:
    """defer_reduce hands back the split-K partials; summed (in order, + bias) they are exactly y."""
    qweight, scales, zeros = _weights(40, 192, 32, torch.float32)  # 6 groups: 3 splits of 2
    x, bias = torch.randn(2 if path == "gemv" else 5, 192), torch.randn(40)
    y = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path=path, split_k=3)
    parts = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path=path, split_k=3, defer_reduce=True)
    assert parts.partials.shape == (3, x.shape[0], 40) and parts.shape == y.shape
    assert torch.equal(parts.reduced(), y)
    one = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path=path, split_k=1, defer_reduce=True)
    assert isinstance(one, torch.Tensor)  # nothing to defer without a split


def test_pick_path_and_configs() -> None:
    assert wg.pick_path(1) == "gemv" and wg.pick_path(wg.GEMV_MAX_M) == "gemv"
    assert wg.pick_path(wg.GEMV_MAX_M + 1) == "tiled" and wg.pick_path(wg.TILED_MAX_M) == "tiled"
    assert wg.pick_path(wg.TILED_MAX_M + 1) == "dequant"
    assert {c.group_size for c in wg.GEMV_CONFIGS} == set(wg.SUPPORTED_GROUP_SIZES)
    assert all(c.block_m >= 16 and c.block_n >= 16 for c in wg.TILED_CONFIGS)  # tl.dot minimum


@pytest.mark.parametrize("capability,expected", [((8, 6), "pre_hopper"), ((8, 9), "pre_hopper"), ((9, 0), "hopper"),
                                                 ((10, 0), "hopper"), ((12, 0), "pre_hopper")])
def test_tiled_configs_follow_the_architecture(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                               expected: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    configs = wg.tiled_configs(cuda)
    assert configs is (wg.TILED_CONFIGS_PRE_HOPPER if expected == "pre_hopper" else wg.TILED_CONFIGS)
    # Before Hopper the 64-row tile runs 8 warps (4 warps needed 254 registers on sm_86).
    assert wg.tiled_config(64, cuda).num_warps == (8 if expected == "pre_hopper" else 4)
    assert wg.tiled_config(16, cuda) == wg.TILED_CONFIGS[0]
    assert wg.tiled_configs(torch.device("cpu")) is wg.TILED_CONFIGS


def test_large_m_uses_dequant_path() -> None:
    qweight, scales, zeros = _weights(8, 64, 32, torch.float32)
    x = torch.randn(wg.TILED_MAX_M + 3, 64)
    torch.testing.assert_close(wg.w4a16_gemm(x, qweight, scales, zeros), ref.w4a16_gemm(x, qweight, scales, zeros),
                               atol=1e-4, rtol=1e-4)


def test_empty_m() -> None:
    qweight, scales, zeros = _weights(8, 64, 32, torch.float16)
    assert wg.w4a16_gemm(torch.empty(0, 64).half(), qweight, scales, zeros).shape == (0, 8)


@pytest.mark.parametrize("case", ["k_mismatch", "group", "x_dtype", "qw_dtype", "x_stride", "qw_noncontig",
                                  "bias_shape", "zeros_shape", "n_not_mult8", "ragged_groups"])
def test_validation_errors(case: str) -> None:
    qweight, scales, zeros = _weights(16, 128, 32, torch.float16)
    x = torch.randn(2, 128).half()
    bias = None
    if case == "k_mismatch":
        x = torch.randn(2, 64).half()
    elif case == "group":
        scales, zeros = torch.rand(8, 16).half(), torch.zeros(8, 16).half()  # G = 16: not supported
    elif case == "x_dtype":
        x = torch.randint(0, 3, (2, 128))
    elif case == "qw_dtype":
        qweight = qweight.to(torch.int64)
    elif case == "x_stride":
        x = torch.randn(128, 2).half().t()
    elif case == "qw_noncontig":
        qweight = torch.cat([qweight, qweight], 1)[:, ::2]
    elif case == "bias_shape":
        bias = torch.zeros(15).half()
    elif case == "zeros_shape":
        zeros = zeros[:, :8]
    elif case == "n_not_mult8":
        qweight, scales, zeros = qweight[:12], scales[:, :12].contiguous(), zeros[:, :12].contiguous()
    elif case == "ragged_groups":
        scales, zeros = torch.rand(3, 16).half(), torch.zeros(3, 16).half()  # 128 % 3 != 0
    with pytest.raises(ValueError):
        wg.w4a16_gemm(x, qweight, scales, zeros, bias)


def test_dequant_path_in_slabs(monkeypatch) -> None:
    """A slab budget smaller than the weight: W is dequantized a few rows at a time (the last
    slab partial, N = 8 * odd), with bias, and the result still matches the reference."""
    assert wg.dequant_slab_rows(28672, 4096, 2) == 4096  # Llama-3-8B gate/up: 7 slabs of 32 MiB
    assert wg.dequant_slab_rows(100, 4096, 2) == 100  # small layers: one slab
    n, k, g = 200, 128, 32
    qweight, scales, zeros = _weights(n, k, g, torch.float16)
    monkeypatch.setattr(wg, "DEQUANT_SLAB_BYTES", 64 * k * 2)  # 64 rows of fp16 per slab
    assert wg.dequant_slab_rows(n, k, 2) == 64  # 200 rows -> slabs of 64, 64, 64, 8
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4)).half()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).half()
    got = wg.w4a16_gemm_path(x, qweight, scales, zeros, bias, path="dequant")
    torch.testing.assert_close(got.float(), ref.w4a16_gemm(x, qweight, scales, zeros, bias).float(),
                               **_tol(torch.float16))


def test_f16_decode_switch(kernel_env) -> None:
    """fp16 with integer zeros takes the pair decode (plain Triton on the interpreter); LIGHTINFER_F16_DECODE=0,
    other dtypes, fp32 scales and zeros not known to be integers the fp32 one, with the same result (both are
    exact before the scale)."""
    assert wg.f16_decode(torch.float16, integer_zeros=True) == {"F16_DECODE": True, "USE_PTX": False,
                                                                "INTEGER_ZEROS": True}
    assert wg.f16_decode(torch.float16) == {"F16_DECODE": False, "USE_PTX": False, "INTEGER_ZEROS": False}
    assert not wg.f16_decode(torch.bfloat16, integer_zeros=True)["F16_DECODE"]
    assert not wg.f16_decode(torch.float16, torch.float32, integer_zeros=True)["F16_DECODE"]  # fp32 scales
    assert wg.f16_decode(torch.float16, ptx=True)["USE_PTX"]
    qweight, scales, zeros = _weights(72, 256, 64, torch.float16)
    x = torch.randn(5, 256).half()
    pair = wg.w4a16_gemm_path(x, qweight, scales, zeros, path="tiled", integer_zeros=True)
    assert torch.equal(wg.w4a16_gemm_path(x, qweight, scales, zeros, path="tiled"), pair)  # the two-step fp32 decode
    kernel_env(switches.F16_DECODE_ENV, "0")
    assert not wg.f16_decode(torch.float16, integer_zeros=True)["F16_DECODE"]
    assert torch.equal(wg.w4a16_gemm_path(x, qweight, scales, zeros, path="tiled", integer_zeros=True), pair)


def test_fractional_zeros_dequantize_to_the_reference_bits() -> None:
    """The dequant kernel with fractional zeros (fp32 decode in two steps, then the scale) gives exactly the
    reference dequantization, in fp16 as in fp32: nothing rounded before the weight itself."""
    for dtype in (torch.float16, torch.float32):
        qweight, scales, zeros = _weights(72, 256, 32, dtype, fractional=True)
        assert torch.equal(wg.dequantize_w4(qweight, scales, zeros, dtype), ref.dequantize_w4(qweight, scales, zeros))


@pytest.mark.parametrize("path", ["tiled", "dequant"])
def test_fp32_scales_with_fp16_activations_are_not_rounded(path: str) -> None:
    """fp16 x with fp32 scales keeps the fp32 decode: the result equals the one from exact fp32 weights."""
    qweight, scales, zeros = _weights(64, 256, 64, torch.float32)
    scales = scales * (1 + 1e-4 * torch.rand_like(scales))  # not representable in fp16
    x = torch.randn(70, 256).half()
    w = ref.dequantize_w4(qweight, scales, zeros).to(torch.float16)
    got = wg.w4a16_gemm_path(x, qweight, scales, zeros, path=path)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), atol=2e-2, rtol=2e-2)
    if path == "dequant":
        assert torch.equal(wg.dequantize_w4(qweight, scales, zeros, torch.float16), w)
