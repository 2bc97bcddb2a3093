"""Writing a quantized checkpoint atomically.

Everything is written into a temporary folder next to the target (same file system) and
renamed onto it at the very end, so an interrupted or failed ``quantize`` leaves nothing
behind: neither a half-written model nor the temporary folder (a SIGKILL, which no code can catch,
leaves the temporary folder; the next ``quantize`` to the same target removes it). The folder holds
``config.json`` (with ``quantization_config``), ``model.safetensors``, the tokenizer files and
``generation_config.json`` (DESIGN.md "Formats").
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
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


# When this process started (close enough: the module loads at the start of a quantize); a temporary folder
# older than this cannot belong to this run.
_PROCESS_START = time.time()


def remove_stale_temp_dirs(out: Path) -> list[Path]:
    """Remove the temporary folders an earlier, killed ``quantize`` to ``out`` left next to it: ours are named
    ``.NAME.tmp-PID-*`` (``.NAME.old-PID-*`` while a ``--force`` swaps folders). Only SIGKILL (or a crash of the
    machine) leaves one, so every one older than this process is stale, unless its PID is a live process
    other than this one (another ``quantize`` to the same target, still running).

    Returns:
        The folders removed (the caller says so).
    """
    removed = []
    for d in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        m = _TEMP_NAME.fullmatch(d.name[len(out.name) + 1:])
        if not m or not d.is_dir() or d.is_symlink():
            continue
        try:
            if d.stat().st_mtime >= _PROCESS_START:
                continue
        except OSError:
            continue
        pid = int(m.group(2)) if m.group(2) else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


_TEMP_NAME = re.compile(r"\.(tmp|old)-(?:(\d+)-)?[a-z0-9_]{8}")  # tempfile.mkdtemp adds 8 of these


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def _sigterm_to_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class AtomicOutputDir:
    """``with AtomicOutputDir(out, force) as tmp:`` write into ``tmp``; on success ``tmp``
    becomes ``out`` (replacing it when ``force``); on any exception, KeyboardInterrupt
    included (SIGTERM is turned into one while the block runs in the main thread), ``tmp`` and
    any parent folders this created are removed, a line saying so is printed to stderr, and the
    exception propagates. Only SIGKILL can leave a hidden ``.NAME.tmp-PID-*`` folder (never ``out``); the next
    run to the same target removes it (:func:`remove_stale_temp_dirs`) and says so."""

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
        stale = remove_stale_temp_dirs(self.out)
        if stale:
            print(f"quantize: removed {len(stale)} temporary folder(s) an interrupted run left next to {self.out}: "
                  f"{', '.join(d.name for d in stale)}", file=sys.stderr)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-{os.getpid()}-", dir=self.out.parent))
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
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-{os.getpid()}-", dir=self.out.parent))
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
