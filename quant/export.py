"""Writing a quantized checkpoint atomically.

Everything is written into a temporary folder next to the target (same file system) and
renamed onto it at the very end, so an interrupted or failed ``quantize`` leaves nothing
behind: neither a half-written model nor the temporary folder. The folder holds
``config.json`` (with ``quantization_config``), ``model.safetensors``, the tokenizer files and
``generation_config.json`` (DESIGN.md "Formats").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors.torch import save_file


def check_output_dir(out: str | Path, force: bool) -> Path:
    """Validate the target before any work.

    Raises:
        FileExistsError: ``out`` is a file, or a non-empty folder and ``force`` is False.
    """
    p = Path(out).expanduser().resolve()
    if p.exists() and not p.is_dir():
        raise FileExistsError(f"--out {str(p)!r} exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise FileExistsError(f"--out {str(p)!r} is not empty; choose another folder or pass --force to replace it")
    return p


def _sigterm_to_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class AtomicOutputDir:
    """``with AtomicOutputDir(out, force) as tmp:`` write into ``tmp``; on success ``tmp``
    becomes ``out`` (replacing it when ``force``); on any exception, KeyboardInterrupt
    included (SIGTERM is turned into one while the block runs in the main thread), ``tmp`` and
    any parent folders this created are removed, a line saying so is printed to stderr, and the
    exception propagates. Only SIGKILL can leave a hidden ``.NAME.tmp-*`` folder (never ``out``)."""

    def __init__(self, out: str | Path, force: bool = False) -> None:
        self.out = check_output_dir(out, force)
        self.force = force
        self.tmp: Path | None = None
        self._created_parents: list[Path] = []
        self._old_sigterm: object = None

    def __enter__(self) -> Path:
        parent = self.out.parent
        missing: list[Path] = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            d.mkdir()
            self._created_parents.append(d)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        if threading.current_thread() is threading.main_thread():  # `kill` (SIGTERM) cleans up too
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        return self.tmp

    def _cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        for d in reversed(self._created_parents):
            try:
                d.rmdir()
            except OSError:
                pass

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.tmp is not None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        if exc_type is not None:
            self._cleanup()
            what = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else f"failed ({exc_type.__name__})"
            print(f"quantize {what}: nothing was written to {self.out} (temporary files removed)", file=sys.stderr)
            return
        old: Path | None = None
        if self.out.exists():
            if self.force:
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
                os.rename(self.out, old / "x")
            else:
                check_output_dir(self.out, force=False)  # appeared meanwhile: raise
                self.out.rmdir()  # an empty folder
        _relax_permissions(self.tmp)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _relax_permissions(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: give the result the usual umask-based permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def write_checkpoint(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    quantization_config: dict[str, Any],
    fmt: str = "awq",
) -> int:
    """Write ``model.safetensors`` and ``config.json`` into ``folder``; returns the safetensors bytes.

    Args:
        tensors: checkpoint name -> CPU tensor (made contiguous here), AWQ layers in AutoAWQ "gemm" layout.
        hf_config: the source model's config as a dict (``PretrainedConfig.to_dict()``).
        quantization_config: the AutoAWQ block (:meth:`QuantConfig.to_hf_dict`).
        fmt: "awq" writes them as they are; "compressed-tensors" converts them, exactly, to
            ``pack-quantized`` (``lightinfer.formats.ct_writer``).
    """
    if fmt == "compressed-tensors":
        from lightinfer.formats.ct_writer import awq_to_compressed_tensors

        tensors, quantization_config = awq_to_compressed_tensors(tensors, quantization_config)
    elif fmt != "awq":
        raise ValueError(f"unknown checkpoint format {fmt!r}; use compressed-tensors or awq")
    path = folder / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    cfg = dict(hf_config)
    cfg["quantization_config"] = quantization_config
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = "float16"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    return path.stat().st_size
