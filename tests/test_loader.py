"""The loader's safety and the messages a newcomer gets: no checkpoint code ever runs (transformers is never
allowed to ask on stdin), and a Hugging Face Hub id gets told how to fetch a local copy."""

from __future__ import annotations

import builtins
import io
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightinfer.cli import main

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def _evil_code(marker: Path) -> str:
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the checkpoint ran its code')\n"


def _remote_config_folder(folder: Path, marker: Path) -> Path:
    """config.json with an unknown model_type and an auto_map to the folder's configuration_evil.py."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "evilmodel", "architectures": ["EvilForCausalLM"],
                                                    "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}))
    (folder / "configuration_evil.py").write_text(_evil_code(marker) + (
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evilmodel'\n"))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    return folder


def _remote_tokenizer_folder(folder: Path, marker: Path) -> Path:
    """A plain Llama config, but tokenizer_config.json maps AutoTokenizer to the folder's tokenization_evil.py."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    (folder / "tokenization_evil.py").write_text(_evil_code(marker) + (
        "from transformers import PreTrainedTokenizer\nclass EvilTokenizer(PreTrainedTokenizer):\n    pass\n"))
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def answer_yes(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdin says "y" to any question; reading it at all fails the test."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))

    def no_input(*_: object) -> str:
        raise AssertionError("something asked a question on stdin during a model load")

    monkeypatch.setattr(builtins, "input", no_input)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(folder: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "generate": ["generate", str(folder), "--prompt", "hi", "--max-tokens", "2"],
        "serve": ["serve", str(folder), "--port", str(_free_port()), "--no-ui"],
        "quantize": ["quantize", str(folder), "--out", str(tmp_path / "out"), "--method", "rtn", "--quiet"],
        "eval-ppl": ["eval-ppl", str(folder), "--max-tokens", "8"],
    }


@pytest.mark.parametrize("command", ["generate", "serve", "quantize", "eval-ppl"])
def test_config_auto_map_code_never_runs(tmp_path: Path, capsys, answer_yes: None, command: str) -> None:
    """Issue 19 item 1: `printf 'y\\n' | lightinfer generate DIR` ran DIR/configuration_*.py. Now every command
    refuses in one line that names config.json and the code it points at, and stdin is never read."""
    marker = tmp_path / "PWNED"
    folder = _remote_config_folder(tmp_path / "remote", marker)
    assert main(_commands(folder, tmp_path)[command]) == 2
    err = capsys.readouterr().err
    assert "config.json needs the model folder's own Python code (configuration_evil.EvilConfig)" in err, err
    assert "never runs code from a checkpoint" in err and "Traceback" not in err
    errors = [line for line in err.strip().splitlines() if not line.startswith("lightinfer: [")]  # progress lines
    assert len(errors) == 1 or command == "quantize", err
    assert not marker.exists()


@pytest.mark.parametrize("how", ["generate", "quantize", "LLM"])
def test_tokenizer_auto_map_code_never_runs(tmp_path: Path, capsys, answer_yes: None, how: str) -> None:
    marker = tmp_path / "PWNED"
    folder = _remote_tokenizer_folder(tmp_path / "remote", marker)
    if how == "LLM":
        from lightinfer import LLM

        with pytest.raises(ValueError, match=r"tokenizer_config\.json needs the model folder's own Python code"):
            LLM(str(folder), load_format="dummy", num_kv_blocks=8)
    else:
        argv = _commands(folder, tmp_path)[how]
        if how == "generate":
            argv += ["--dummy-weights", "--kv-cache-memory", "1MiB"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "tokenizer_config.json needs the model folder's own Python code (tokenization_evil.EvilTokenizer)" \
            in err, err
    assert not marker.exists()


def test_llm_refuses_remote_config_code(tmp_path: Path, answer_yes: None) -> None:
    from lightinfer import LLM

    marker = tmp_path / "PWNED"
    folder = _remote_config_folder(tmp_path / "remote", marker)
    with pytest.raises(ValueError, match="never runs code from a checkpoint"):
        LLM(str(folder))
    assert not marker.exists()


def test_hub_id_explains_local_loading(capsys) -> None:
    """Issue 19 item 13: a Hub id got "no such file or folder"; it now says lightinfer loads local files and how
    to download the repository on a machine with access."""
    assert main(["generate", "HuggingFaceTB/SmolLM2-135M-Instruct", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face Hub id" in err and "loads local folders and files" in err
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR" in err
    assert main(["generate", "./no/such/dir", "--prompt", "hi"]) == 2  # a path stays a path
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "Hub id" not in err
