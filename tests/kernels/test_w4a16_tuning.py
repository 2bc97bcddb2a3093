"""Tuned W4A16 launches: the file format, the M buckets, and that a tuned launch really runs (interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightinfer.kernels import reference as ref
from lightinfer.kernels import switches
from lightinfer.kernels import w4a16_gemm as wg
from lightinfer.kernels import w4a16_tuning as wt
from lightinfer.kernels.w4a16_tuning import W4Launch

N, K, G = 72, 256, 64


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qweight = ref.pack_int4_rows(torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32))
    scales = torch.rand(K // G, N, generator=gen) * 0.02 + 0.002
    zeros = torch.randint(0, 16, (K // G, N), generator=gen).float()
    return qweight, scales, zeros


@pytest.fixture
def tuned_file(tmp_path: Path, kernel_env) -> Path:
    """A tuned file for (N, K, G): M <= 1 gemv 32 rows, split 4; M 2..16 swap_ab 16 tokens x 64 rows x 32, split 2;
    M 17..32 tiled 32x32x64; above: dequant."""
    path = tmp_path / "w4a16_test.json"
    entries = {wt.shape_key(N, K, G): {
        "1": wt.launch_record(W4Launch("gemv", 1, 32, G, 4, 2, 4), us=1.0),
        "16": wt.launch_record(W4Launch("swap_ab", 16, 64, 32, 4, 2, 2), us=2.0),
        "32": wt.launch_record(W4Launch("tiled", 32, 32, 64, 4, 2, 4), us=2.5),
        "64": wt.launch_record(W4Launch("dequant"), us=3.0),
    }}
    path.write_text(json.dumps({"device": "test", "entries": entries}))
    kernel_env(switches.W4A16_CONFIGS_ENV, str(path))
    wt.clear_cache()
    yield path
    wt.clear_cache()


def test_buckets_pick_the_smallest_tuned_m_at_or_above(tuned_file: Path) -> None:
    cpu = torch.device("cpu")
    assert wt.tuned_launch(cpu, 1, N, K, G).path == "gemv"
    assert wt.tuned_launch(cpu, 2, N, K, G) == W4Launch("swap_ab", 16, 64, 32, 4, 2, 2)
    assert wt.tuned_launch(cpu, 16, N, K, G).path == "swap_ab"
    assert wt.tuned_launch(cpu, 17, N, K, G).path == "tiled"
    assert wt.tuned_launch(cpu, 33, N, K, G).path == "dequant"
    assert wt.tuned_launch(cpu, 64, N, K, G).path == "dequant"
    assert wt.tuned_launch(cpu, 65, N, K, G) is None  # above the largest key: the built-in choice
    assert wt.tuned_launch(cpu, 1, N, K, 32) is None  # another group size: untuned
    assert wt.tuned_launch(cpu, 1, 80, K, G) is None


@pytest.mark.parametrize("m", [1, 3, 16, 20, 40])  # each bucket of the file below
def test_tuned_launches_run_and_match_the_reference(tuned_file: Path, m: int) -> None:
    qweight, scales, zeros = _weights()
    x = torch.randn(m, K)
    want = ref.w4a16_gemm(x, qweight, scales, zeros)
    torch.testing.assert_close(wg.w4a16_gemm(x, qweight, scales, zeros), want, atol=1e-4, rtol=1e-4)
    chosen = wg.choose_launch(m, N, K, G, x.device)
    assert chosen == wt.tuned_launch(x.device, m, N, K, G) != wg.default_launch(m, N, K, G, x.device)
    # The tuned split is what the kernel ran: defer_reduce hands back that many partials.
    if chosen.path != "dequant":
        parts = wg.w4a16_gemm(x, qweight, scales, zeros, defer_reduce=True)
        assert parts.partials.shape[0] == chosen.split_k


def test_none_and_untuned_devices_use_the_built_in_launch(tuned_file: Path, kernel_env) -> None:
    kernel_env(switches.W4A16_CONFIGS_ENV, "none")
    assert wt.tuned_launch(torch.device("cpu"), 1, N, K, G) is None
    kernel_env(switches.W4A16_CONFIGS_ENV, None)
    assert wt.tuned_launch(torch.device("cpu"), 1, N, K, G) is None  # no file for the CPU
    assert wg.choose_launch(1, N, K, G, torch.device("cpu")) == wg.default_launch(1, N, K, G, torch.device("cpu"))


def test_a_tuned_gemv_never_runs_past_its_row_limit(tmp_path: Path, kernel_env) -> None:
    path = tmp_path / "gemv_only.json"
    # a (hand-written) gemv entry for M up to 64: the GEMV unrolls over rows and stops at GEMV_FORCED_MAX_M
    path.write_text(json.dumps({"entries": {wt.shape_key(N, K, G): {"64": wt.launch_record(W4Launch("gemv", 4, 32, G))}}}))
    kernel_env(switches.W4A16_CONFIGS_ENV, str(path))
    wt.clear_cache()
    try:
        assert wg.choose_launch(4, N, K, G, torch.device("cpu")).path == "gemv"
        big = wg.GEMV_FORCED_MAX_M + 1
        assert wt.tuned_launch(torch.device("cpu"), big, N, K, G).path == "gemv"
        assert wg.choose_launch(big, N, K, G, torch.device("cpu")) == wg.default_launch(big, N, K, G, torch.device("cpu"))
    finally:
        wt.clear_cache()


def test_device_file_names() -> None:
    assert wt.device_file("NVIDIA H200").name == "w4a16_NVIDIA_H200.json"
    assert wt.device_file("NVIDIA GeForce RTX 3060 (12GB)").name == "w4a16_NVIDIA_GeForce_RTX_3060_12GB.json"


@pytest.mark.parametrize("entry,needle", [
    ({"path": "gemm"}, "not one of"),
    ({"path": "tiled", "block_m": 16, "block_n": 48, "block_k": 32, "num_warps": 4}, "powers of two"),
    ({"path": "tiled", "block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4}, "dividing the group size"),
    ({"path": "gemv", "block_m": 1, "block_n": 32, "block_k": 32, "num_warps": 4}, "block_k must be 64"),
    ({"path": "gemv", "block_m": 1, "block_n": 32, "block_k": 64, "num_warps": 4, "split_k": -1}, "split_k"),
    ({"path": "tiled", "block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "colour": 1}, None),
])
def test_malformed_files_are_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: dict,
                                          needle: str | None) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"entries": {wt.shape_key(N, K, G): {"2": entry}}}))
    if needle is None:  # unknown keys (e.g. "us", "shape") are notes, not errors
        assert wt.parse_file(path)[wt.shape_key(N, K, G)][0][1].block_n == 32
        return
    with pytest.raises(ValueError, match=needle) as err:
        wt.parse_file(path)
    assert str(path) in str(err.value) and "M=2" in str(err.value)


@pytest.mark.parametrize("text", ["not json", json.dumps({"device": "x"}), json.dumps({"entries": {"N=1": {}}})])
def test_unreadable_files_name_the_fix(tmp_path: Path, kernel_env, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    kernel_env(switches.W4A16_CONFIGS_ENV, str(path))
    wt.clear_cache()
    try:
        with pytest.raises(ValueError, match="bad.json"):
            wt.tuned_launch(torch.device("cpu"), 1, N, K, G)
    finally:
        wt.clear_cache()
    kernel_env(switches.W4A16_CONFIGS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="tune_w4a16"):
        wt.tuned_launch(torch.device("cpu"), 1, N, K, G)
    wt.clear_cache()


def test_forced_launch_is_checked() -> None:
    qweight, scales, zeros = _weights()
    with pytest.raises(ValueError, match="block_k"):
        wg.w4a16_gemm_path(torch.randn(1, K), qweight, scales, zeros, launch=W4Launch("gemv", 1, 32, 32, 4, 1))


# ----------------------------------------------------------------------------- the tuner's search


def _tuner():
    from bench.kernels import tune_w4a16

    return tune_w4a16


def test_model_shapes_are_the_engine_layers() -> None:
    tune = _tuner()
    assert tune.model_shapes("llama-2-7b") == {"llama-2-7b/qkv": (4096, 12288), "llama-2-7b/o": (4096, 4096),
                                               "llama-2-7b/gate_up": (4096, 22016), "llama-2-7b/down": (11008, 4096)}
    assert tune.model_shapes("llama-3-8b")["llama-3-8b/qkv"] == (4096, 6144)  # GQA: 32 + 2 x 8 heads of 128
    with pytest.raises(FileNotFoundError, match="llama-2-7b"):
        tune.model_shapes("no-such-model")


def test_search_finds_the_fastest_checked_launch() -> None:
    """A fake timer with a known optimum (gemv, 64 rows, 2 stages, split 6) and a checker that rejects one
    candidate: the staged search must land on the optimum and never on the rejected launch."""
    tune = _tuner()
    k, g = 4096, 128
    default = wg.default_launch(1, 12288, k, g, torch.device("cpu"))
    bad = W4Launch("gemv", 1, 32, g, 4, 1)

    def fake_us(la: W4Launch) -> float:
        if la.path != "gemv":
            return 50.0
        return 10.0 + abs(la.block_n - 64) / 16 + abs(la.num_stages - 2) + abs(la.num_warps - 4) + abs(
            (la.split_k or 9) - 6) / 4

    result = tune.tune_one(1, k, g, default, lambda la: 0.0 if la == bad else fake_us(la),
                           lambda la: "wrong" if la == bad else None)
    assert result["best"] == W4Launch("gemv", 1, 64, g, 4, 2, 6)
    assert result["us"] == 10.0 and result["default_us"] == fake_us(default)
    assert str(bad) in result["rejected"]


def test_search_covers_every_path_at_mid_m() -> None:
    tune = _tuner()
    seen: set[str] = set()

    def us(la: W4Launch) -> float:
        seen.add(la.path)
        return {"dequant": 1.0, "tiled": 2.0, "swap_ab": 2.5, "gemv": 3.0}[la.path]

    default = wg.default_launch(8, 4096, 4096, 128, torch.device("cpu"))
    assert tune.paths_for(1) == tune.paths_for(8) == ["gemv", "tiled", "swap_ab"]
    assert tune.paths_for(64) == ["tiled", "swap_ab", "dequant"]
    assert tune.tune_one(8, 4096, 128, default, us, lambda la: None)["best"].path == "tiled"
    assert tune.tune_one(64, 4096, 128, default, us, lambda la: None)["best"] == W4Launch("dequant")
    assert seen == {"gemv", "tiled", "swap_ab", "dequant"}


def test_merge_keeps_other_entries(tmp_path: Path) -> None:
    tune = _tuner()
    path = tmp_path / "t.json"
    key = wt.shape_key(N, K, G)
    rec = wt.launch_record(W4Launch("dequant"), us=1.0)
    path.write_text(json.dumps(tune.merge_entries(path, {"device": "x"}, {key: {16: rec}})))
    merged = tune.merge_entries(path, {"device": "x"}, {key: {2: rec}, "N=8,K=64,G=64": {1: rec}})
    assert list(merged["entries"][key]) == ["2", "16"] and "N=8,K=64,G=64" in merged["entries"]
    path.write_text(json.dumps(merged))
    assert [m for m, _ in wt.parse_file(path)[key]] == [2, 16]


@pytest.mark.audit  # every tuning candidate launched under the interpreter: ~20 s (`make test-audit`)
def test_every_candidate_runs_under_the_interpreter() -> None:
    """The tuner end to end on CPU at a small shape: every launch it generates compiles and matches the built-in
    one (a bad candidate would be 'rejected' with its error), and the winner is a launch the file can hold."""
    tune = _tuner()
    calls: list[int] = []

    def timer(fn, final: bool) -> float:
        fn()
        calls.append(final)
        return float(len(calls) % 7)  # arbitrary but deterministic

    result = tune.tune_shape_m(256, 64, 2, 64, True, print, device="cpu", timer=timer)
    assert result["rejected"] == {}
    assert result["timed"] > 20 and calls[-1] is True  # finalists re-timed in the final round
    wt.check_launch(result["best"], 64)


def test_tuner_cli_writes_merges_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main() with the GPU parts faked: one valid file entry per (shape, M), a copy in --copy-to after
    every pair, and --skip-done tunes nothing twice."""
    tune = _tuner()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    pairs: list[tuple[int, int, int]] = []

    def fake(k: int, n: int, m: int, g: int, quick: bool, log, **kw) -> dict:
        pairs.append((k, n, m))
        best = W4Launch("gemv", 1, 64, g, 4, 2, 4) if m == 1 else W4Launch("dequant")
        return {"best": best, "us": 1.0, "default_us": 2.0, "timed": 1, "rejected": {}}

    monkeypatch.setattr(tune, "tune_shape_m", fake)
    out, copy = tmp_path / "configs" / "w4a16_Fake_GPU.json", tmp_path / "out"
    args = ["--models", "llama-2-7b", "--m", "1", "64", "--out", str(out), "--copy-to", str(copy)]
    assert tune.main(args) == 0
    assert len(pairs) == 8 and (copy / out.name).read_text() == out.read_text()
    table = wt.parse_file(out)
    assert table[wt.shape_key(12288, 4096, 128)] == [(1, W4Launch("gemv", 1, 64, 128, 4, 2, 4)), (64, W4Launch("dequant"))]
    assert json.loads(out.read_text())["device"] == "Fake GPU"
    assert tune.main(args + ["--skip-done", "--m", "1", "2"]) == 0
    assert len(pairs) == 12 and {m for _, _, m in pairs[8:]} == {2}  # only the new M
    assert [m for m, _ in wt.parse_file(out)[wt.shape_key(4096, 4096, 128)]] == [1, 2, 64]


def test_tuner_starts_afresh_over_an_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    tune = _tuner()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(tune, "tune_shape_m", lambda k, n, m, g, quick, log, **kw: {
        "best": W4Launch("dequant"), "us": 1.0, "default_us": 1.0, "timed": 1, "rejected": {}})
    out = tmp_path / "w4a16_Fake_GPU.json"
    out.write_text('{"entries": {"N=4096,K=4096,G=128": {"1": {"path": "gemv"')  # a write cut short
    assert tune.main(["--models", "llama-2-7b", "--m", "64", "--out", str(out), "--skip-done"]) == 0
    assert "not a readable tuned file" in capsys.readouterr().err
    assert len(wt.parse_file(out)) == 4 and not list(tmp_path.glob("*.tmp"))
