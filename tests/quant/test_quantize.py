"""End to end on tiny random-weight checkpoints: the written format, loading it back, the CLI,
and every bad input of issue 3 (each stopped with a clear message, nothing left behind)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lightinfer.cli import main as cli_main
from lightinfer.quant.api import quantize
from lightinfer.quant.config import QuantConfig
from tests.conftest import SMOLLM2, requires_smollm2, write_tiny_checkpoint

FAST = {"num_samples": 4, "seq_len": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", intermediate_size=192)


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from lightinfer.layers.attention import no_cache_context
    from lightinfer.loader import Checkpoint, load_weights
    from lightinfer.models.registry import get_model_class

    ck = Checkpoint(str(path))
    model = get_model_class(ck.hf_config)(ck.hf_config, ck.quant_config, torch.float32)
    load_weights(model, ck)
    with torch.no_grad(), no_cache_context(torch.tensor([0, ids.numel()], dtype=torch.int32)):
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_awq_checkpoint_format_and_reload(tmp_path: Path, arch: str) -> None:
    src = write_tiny_checkpoint(tmp_path / "src", arch=arch, intermediate_size=192)
    out = tmp_path / "out"
    summary = quantize(str(src), out, QuantConfig(group_size=32, format="awq", **FAST), progress=False)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "generation_config.json",
                                               "tokenizer.json", "tokenizer_config.json"}
    assert not list(tmp_path.glob(".out.tmp-*"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": ["lm_head"]}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        qw = f.get_tensor("model.layers.1.mlp.down_proj.qweight")
        qz = f.get_tensor("model.layers.1.mlp.down_proj.qzeros")
        sc = f.get_tensor("model.layers.1.mlp.down_proj.scales")
    assert qw.dtype == torch.int32 and qw.shape == (192, 64 // 8)
    assert qz.dtype == torch.int32 and qz.shape == (192 // 32, 64 // 8)
    assert sc.dtype == torch.float16 and sc.shape == (192 // 32, 64)
    assert "lm_head.weight" in names and not any(n.endswith("proj.weight") for n in names)
    assert summary.group_size == 32 and summary.linear_ratio < 0.30
    ids = torch.randint(0, 256, (48,))
    ref, got = _logits(src, ids), _logits(out, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.25  # random weights: 4-bit noise, not a broken load


def test_awq_beats_rtn_on_outlier_model(tmp_path: Path) -> None:
    src = write_tiny_checkpoint(tmp_path / "src", intermediate_size=192)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    for k in sd:
        if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            sd[k][:3] *= 30.0  # outlier activation channels
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (64,))
    ref = _logits(src, ids)
    errs = {}
    for method in ("rtn", "awq"):
        quantize(str(src), tmp_path / method, QuantConfig(method=method, group_size=32, **FAST), progress=False)
        errs[method] = float((_logits(tmp_path / method, ids) - ref).pow(2).mean())
    assert errs["awq"] < errs["rtn"], errs


def test_cli_quantize_and_eval_ppl(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    assert cli_main(["quantize", str(tiny), "--out", str(out), "--method", "rtn", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "group size 64" in text and "128 does not divide" in text and "peak memory" in text
    assert "MiB" in text and "time:" in text
    txt = tmp_path / "eval.txt"
    txt.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert cli_main(["eval-ppl", str(out), "--text", str(txt), "--kv-cache-dtype", "int8",
                     "--max-tokens", "300", "--window", "128"]) == 0
    text = capsys.readouterr().out
    assert "299 tokens scored" in text or "297 tokens scored" in text, text


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv,msg", [
    (["--group-size", "96"], "group_size 96 is not supported"),
    (["--w-bit", "3"], "w_bit 3 is not supported"),
])
def test_cli_rejects_bad_settings(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  argv: list[str], msg: str) -> None:
    out = tmp_path / "q"
    assert cli_main(["quantize", str(tiny), "--out", str(out), *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not out.exists()


def test_group_size_not_dividing_a_layer(tmp_path: Path) -> None:
    src = write_tiny_checkpoint(tmp_path / "src", hidden_size=96, intermediate_size=192, num_attention_heads=3,
                                num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"--group-size 128 does not divide in_features=96 of layer "
                                         r"'model\.layers\.0\.self_attn\.q_proj'.*would work: 32"):
        quantize(str(src), tmp_path / "out", QuantConfig(group_size=128))
    assert not (tmp_path / "out").exists()


@requires_smollm2
def test_group_size_128_on_smollm2(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"in_features=576 .*would work: 64, 32"):
        quantize(SMOLLM2, tmp_path / "out", QuantConfig(group_size=128))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    src = write_tiny_checkpoint(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*supported: .*LlamaForCausalLM"):
        quantize(str(src), tmp_path / "out", QuantConfig())
    assert not (tmp_path / "out").exists()


def test_non_empty_out_refused_then_forced(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*--force"):
        quantize(str(tiny), out, QuantConfig(method="rtn"))
    assert (out / "keep.txt").read_text() == "mine"
    quantize(str(tiny), out, QuantConfig(method="rtn"), force=True, progress=False)
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("content,suffix,msg", [
    ("", ".txt", "holds no text"),
    ("Too short.", ".txt", "too short"),
    ('{"txt": "x"}\n', ".jsonl", "field 'text'"),
    ("a,b\n", ".csv", ".txt or .jsonl"),
])
def test_bad_calibration_files(tiny: Path, tmp_path: Path, content: str, suffix: str, msg: str) -> None:
    calib = tmp_path / f"calib{suffix}"
    calib.write_text(content)
    with pytest.raises(ValueError, match=msg):
        quantize(str(tiny), tmp_path / "out", QuantConfig(calib=str(calib), **FAST))
    assert not (tmp_path / "out").exists()


def test_interrupt_leaves_nothing(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from lightinfer.quant import awq

    real = awq.quantize_layer
    calls = []

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(awq, "quantize_layer", interrupted)
    out = tmp_path / "nested" / "out"
    assert cli_main(["quantize", str(tiny), "--out", str(out), "--num-samples", "2", "--seq-len", "64",
                     "--quiet"]) == 130
    assert "interrupted: nothing was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output, no temp folder, no created parent


def test_already_quantized_source_refused(tiny: Path, tmp_path: Path) -> None:
    quantize(str(tiny), tmp_path / "q", QuantConfig(method="rtn"), progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(str(tmp_path / "q"), tmp_path / "q2", QuantConfig(method="rtn"))


@pytest.mark.parametrize("field,value", [("bits", 3), ("version", "gemv"), ("zero_point", False),
                                         ("quant_method", "gptq"), ("group_size", 48)])
def test_engine_refuses_unrunnable_quantization_config(tiny: Path, tmp_path: Path, field: str, value: object) -> None:
    from lightinfer import LLM

    out = tmp_path / "q"
    quantize(str(tiny), out, QuantConfig(method="rtn", group_size=32, format="awq"), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"][field] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        LLM(str(out))


def test_sigterm_leaves_nothing(tmp_path: Path) -> None:
    import os
    import signal

    from lightinfer.quant.export import AtomicOutputDir

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), AtomicOutputDir(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_modules_to_not_convert_inside_layers(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    quantize(str(tiny), out, QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "down_proj"], format="awq",
                                         **FAST),
             progress=False)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.float16
    assert "model.layers.0.mlp.down_proj.qweight" not in names and "model.layers.0.mlp.up_proj.qweight" in names
    ids = torch.randint(0, 256, (32,))
    ref, got = _logits(tiny, ids), _logits(out, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.25


def test_sigkill_leftovers_are_removed_by_the_next_run(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Issue 19 item 8: a SIGKILLed quantize left a .NAME.tmp-* folder that later runs never cleaned. The next run
    to the same target removes its own kind of leftovers (older than itself, no live owner) and says so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from lightinfer.quant import export
    from lightinfer.quant.export import AtomicOutputDir

    out = tmp_path / "model"
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from lightinfer.quant.export import AtomicOutputDir\n"
        f"with AtomicOutputDir({str(out)!r}) as tmp:\n"
        "    (tmp / 'model.safetensors').write_bytes(b'partial')\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = list(tmp_path.glob(".model.tmp-*"))
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()  # what SIGKILL leaves
    # a leftover of another live quantize to the same target, and folders that are not ours, stay
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".model.tmp-{sleeper.pid}-abc12345"
        others = [tmp_path / ".other.tmp-1-abc12345", tmp_path / ".model.tmp-my-notes"]
        for d in (busy, *others):
            d.mkdir()
        stale_old = tmp_path / ".model.old-1-xyz12345"  # pid 1 is alive, but it is not a quantize: kept too
        stale_old.mkdir()
        monkeypatch.setattr(export, "_PROCESS_START", time.time() + 1)  # as a run started after all of them
        with AtomicOutputDir(out) as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        sleeper.kill()
    err = capsys.readouterr().err
    assert f"removed 1 temporary folder(s) an interrupted run left next to {out}: {left[0].name}" in err
    assert not left[0].exists() and (out / "config.json").is_file()
    assert busy.is_dir() and all(d.is_dir() for d in others) and stale_old.is_dir()
    assert os.getpid() != sleeper.pid
