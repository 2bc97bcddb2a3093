"""The C ops of ``kernels/cpu_native.py`` against the torch ops they replace (``LIGHTINFER_CPU_NATIVE=0``) and
the reference backend, their fallbacks, and the build."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest
import torch

from lightinfer.kernels import PagedKV, cpu_fused, cpu_native, switches, torch_cpu
from lightinfer.kernels import reference as ref

needs_native = pytest.mark.skipif(cpu_native.find_compiler() is None, reason="no C compiler on this machine")


def _torch_path() -> object:
    return switches.override(cpu_native=False)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors of one sign pattern."""
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max())


@needs_native
def test_the_library_builds_where_a_compiler_is() -> None:
    assert cpu_native.library() is not None, cpu_native.status


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_the_torch_ops(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(7, 576, generator=gen).to(dtype) for _ in range(2))
    w = torch.rand(576, generator=gen).to(dtype)
    got_norm, got_res = cpu_native.add_rms_norm(x, r, w, 1e-5)
    with _torch_path():
        want_norm, want_res = cpu_fused.fused_add_rms_norm(x, r, w, 1e-5)
        want_plain = cpu_fused.rms_norm(x, w, 1e-5)
    assert torch.equal(got_res, want_res)  # the residual add rounds as torch's does
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_norm, want_norm, rtol=tol, atol=tol)
    torch.testing.assert_close(cpu_native.add_rms_norm(None, x, w, 1e-5)[0], want_plain, rtol=tol, atol=tol)
    torch.testing.assert_close(got_norm.float(), ref.fused_add_rms_norm(x, r, w, 1e-5)[0].float(), rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])  # 300: the threaded loop
def test_the_qk_norms_in_place_match_each_head_normed_alone(dtype: torch.dtype, tokens: int) -> None:
    """li_qk_norm normalizes each q head and each k head of a fused qkv output in place (Qwen3's q/k norms), as
    li_add_rms_norm normalizes a row; v is untouched; the reference twin agrees within rounding."""
    gen = torch.Generator().manual_seed(tokens)
    h, hkv, d = 6, 2, 64
    qkv = torch.randn(tokens, (h + 2 * hkv) * d, generator=gen).to(dtype)
    qw, kw = (torch.rand(d, generator=gen).to(dtype) + 0.5 for _ in range(2))
    got, want = qkv.clone(), qkv.clone()
    assert cpu_native.qk_norm_(got, h, hkv, qw, kw, 1e-6)
    heads = qkv.unflatten(-1, (h + 2 * hkv, d))
    rows = [cpu_native.add_rms_norm(None, heads[:, i].contiguous(), qw if i < h else kw, 1e-6)[0]
            for i in range(h + hkv)]
    assert torch.equal(got.unflatten(-1, (h + 2 * hkv, d))[:, : h + hkv], torch.stack(rows, dim=1))
    assert torch.equal(got[:, (h + hkv) * d:], qkv[:, (h + hkv) * d:])
    assert ref.qk_rms_norm_(want, h, hkv, qw, kw, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not cpu_native.qk_norm_(got.t(), h, hkv, qw, kw, 1e-6)  # strided rows: declined, untouched


@needs_native
def test_parallel_rows_equal_one_row_at_a_time() -> None:
    """Enough rows to take the threaded loop: each row as computed alone."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2 * 1536, generator=gen).to(torch.bfloat16)
    whole = cpu_native.silu_mul(x)
    assert torch.equal(whole, torch.cat([cpu_native.silu_mul(x[i: i + 1]) for i in range(64)]))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_torch_op(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2 * 300, generator=gen) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails of exp
    got = cpu_native.silu_mul(x)
    with _torch_path():
        want = cpu_fused.silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
    else:
        assert _bf16_ulps(got, want) <= 1


@needs_native
@pytest.mark.parametrize("rotary_dim", [64, 48])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rope_store_is_the_torch_op_bit_for_bit(cache_dtype: torch.dtype, rotary_dim: int) -> None:
    """Whole heads rotated, and (48 of 64 dims) partial rotation as Phi-3's partial_rotary_factor."""
    gen = torch.Generator().manual_seed(4)
    d, hq, hk, t = 64, 6, 2, 5
    act = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16

    def cache() -> PagedKV:
        scales = [torch.zeros(6, 4, hk, dtype=torch.float16) for _ in range(4)] if cache_dtype == torch.int8 else []
        return PagedKV(torch.zeros(6, 4, hk, d, dtype=cache_dtype), torch.zeros(6, 4, hk, d, dtype=cache_dtype),
                       *scales)

    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(act)
    positions = torch.tensor([0, 3, 90, 2, 17])
    slots = torch.tensor([0, 5, -1, 19, 23])
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    a, b = cache(), cache()
    qa = cpu_native.rope_store(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), a, slots)
    with _torch_path():
        qb = cpu_fused.rope_store_kvcache(positions, qkv, hq, hk, freqs.cos(), freqs.sin(), b, slots)
    assert qa is not None and torch.equal(qa, qb)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def _cache(lens: list[int], kind: torch.dtype, gen: torch.Generator, block_size: int = 16,
           hk: int = 3, d: int = 64) -> tuple[PagedKV, torch.Tensor, torch.Tensor]:
    """Random K/V for sequences of ``lens`` tokens in shuffled blocks (INT8 written by the reference store)."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(blocks) + 1), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[used: used + nb].int()
        used += nb
    shape = (num_blocks, block_size, hk, d)
    if kind != torch.int8:
        kv = PagedKV(torch.randn(shape, generator=gen).to(kind), torch.randn(shape, generator=gen).to(kind))
    else:
        kv = PagedKV(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                     *[torch.zeros(shape[:3], dtype=torch.float16) for _ in range(4)])
        for i, n in enumerate(lens):
            slots = tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
            ref.store_kvcache(torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen), kv, slots)
    return kv, tables, torch.tensor(lens, dtype=torch.int32)


@needs_native
@pytest.mark.parametrize("kind", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("lens", [[1], [200], [3, 50, 17, 1, 33], [300] * 12])  # the last takes the threads
def test_decode_attention_matches_the_reference(kind: torch.dtype, lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(5)
    kv, tables, context_lens = _cache(lens, kind, gen)
    act = torch.float32 if kind == torch.float32 else torch.bfloat16
    q = torch.randn(len(lens), 9, 64, generator=gen).to(act)
    got = cpu_native.attend_decode(q, kv, tables, context_lens, 0.125)
    want = ref.paged_attention_decode(q, kv, tables, context_lens, 0.125)
    assert got is not None and got.dtype == act
    tol = 2e-5 if act == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_native
def test_what_the_c_ops_do_not_take_goes_to_the_torch_ops() -> None:
    gen = torch.Generator().manual_seed(6)
    kv, tables, lens = _cache([20, 9], torch.float32, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    assert cpu_native.attend_decode(q.half(), kv, tables, lens, 0.1) is None  # fp16 activations
    assert cpu_native.silu_mul(torch.randn(3, 8, dtype=torch.float16)) is None
    assert cpu_native.silu_mul(torch.randn(8, 3).t()) is None  # strided
    bad = tables.clone()
    bad[0, 0] = kv.num_blocks  # a block id out of the pool: refused, not read
    assert cpu_native.attend_decode(q, kv, bad, lens, 0.1) is None
    assert cpu_native.attend_decode(q, kv, tables, torch.tensor([20, 0], dtype=torch.int32), 0.1) is None
    # the backend then runs its torch ops: a window still works
    out = torch_cpu.paged_attention_decode(q, kv, tables, lens, 0.1, window=4)
    torch.testing.assert_close(out, ref.paged_attention_decode(q, kv, tables, lens, 0.1, window=4),
                               rtol=1e-5, atol=1e-5)
    positions, slots = torch.tensor([1000]), torch.tensor([0])  # past the rotary table
    freqs = torch.zeros(16, 32)
    assert cpu_native.rope_store(positions, torch.randn(1, 15 * 64), 9, 3, freqs, freqs, kv, slots) is None


def test_switched_off_means_no_library() -> None:
    with switches.override(cpu_native=False):
        assert cpu_native.library() is None
        assert cpu_native.silu_mul(torch.randn(2, 8)) is None


def test_a_failing_compiler_leaves_no_library_and_says_why(tmp_path: Path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error: no such option' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = tmp_path / "cache" / "ops.so"
    with pytest.raises(cpu_native.NativeBuildError, match="no such option"):
        cpu_native.build(str(fake), out)
    assert list(out.parent.iterdir()) == []  # no half-written library left behind


def test_without_a_compiler_the_ops_fall_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "status", "not loaded")
    monkeypatch.setattr(cpu_native, "find_compiler", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build to find either
    assert cpu_native.library() is None
    assert "no C compiler" in cpu_native.status and "no C compiler" in caplog.text
    x = torch.randn(2, 16)
    assert torch.equal(cpu_fused.silu_and_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])


@needs_native
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
@pytest.mark.audit  # four compiles of every C source, ~25 s (`make test-audit`)
@pytest.mark.parametrize("march", ["x86-64", "haswell", "icelake-server", "sapphirerapids"])
def test_the_c_ops_compile_for_every_x86_generation(march: str, tmp_path: Path) -> None:
    """The library is built with -march=native on the user's CPU, so each source must compile for CPUs other
    than the one running the tests: without AVX at all, AVX2 only (a cpu_sample.c that took size_t from
    immintrin.h failed there, and every op fell back to torch), AVX-512 with VBMI, and AVX-512 with AMX."""
    flags = [f for f in cpu_native.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    for src in cpu_native.SOURCES:
        done = subprocess.run([cpu_native.find_compiler(), *flags, f"-march={march}", "-fopenmp-simd", "-S",
                               "-o", str(tmp_path / "out.s"), str(src)], capture_output=True, text=True, check=False)
        if "march" in done.stderr and "bad value" in done.stderr:
            pytest.skip(f"this compiler does not know -march={march}")
        assert done.returncode == 0, f"{src.name} for -march={march}:\n{done.stderr}"


@needs_native
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 targets")
def test_an_older_target_builds_for_it_and_chooses_its_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """LIGHTINFER_CPU_MARCH=haswell on any x86 CPU: the library is built for AVX2 and the paths are those of an
    AVX2-only CPU (no bf16 GEMM, no AMX), whatever this CPU has."""
    cpu_native.cpu_flags.cache_clear()
    with switches.override(cpu_march="haswell"):
        try:
            assert "-march=haswell" in cpu_native.build_flags() and "-march=native" not in cpu_native.build_flags()
            flags = cpu_native.cpu_flags()
        finally:
            cpu_native.cpu_flags.cache_clear()
    assert "avx2" in flags and not flags & {"avx512f", "avx512_bf16", "amx_bf16"}
    with switches.override(cpu_march="native"):
        assert "-march=native" in cpu_native.build_flags()


@needs_native
def test_a_declined_op_says_why_in_the_recording() -> None:
    """The replay contract: inside a recording an op either appends its call or notes why it declined; outside
    one a decline costs nothing but the None."""
    with cpu_native.recording(64) as rec:
        assert cpu_native.silu_mul(torch.randn(3, 8, dtype=torch.float16)) is None
        assert cpu_native.silu_mul(torch.randn(3, 8)) is not None
        assert not cpu_native.qk_norm_(torch.randn(2, 64).t(), 1, 1, torch.ones(16), torch.ones(16), 1e-6)
        cpu_native.declined("attend_decode", "a sliding window")
    assert rec.declined == [("silu_mul", "torch.float16 activations"), ("qk_norm", "a strided input"),
                            ("attend_decode", "a sliding window")]
    assert [name for name, _ in rec.calls] == ["li_silu_mul"]
    assert cpu_native.silu_mul(torch.randn(3, 8, dtype=torch.float16)) is None  # no recording: nothing kept
    assert len(rec.declined) == 3
