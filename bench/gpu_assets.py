"""Take the AWQ SmolLM2 to the GPU machine, whose working-tree transfer is capped at 64 MiB.

The device image has no ``gguf`` package and cannot download, so the GPU-vs-CPU check of issue 6
(SmolLM2, AWQ, INT8 KV) needs the AWQ export (safetensors, 109 MB) on the machine. It travels in
two device calls, one half each, as git-ignored folders named in ``carry``; the machine keeps
ignored files between calls while it is warm (30 s idle), so the second call must follow at once::

    python bench/gpu_assets.py prepare          # here: .gpu_assets/{smollm2-awq,part1,part2}
    run(command="true", carry=[".gpu_assets/smollm2-awq", ".gpu_assets/part1"])
    run(command="bash bench/gpu_checks.sh smollm2", carry=[".gpu_assets/part2"])   # joins, tests

``join`` (run by that stage) concatenates the parts and checks the SHA-256 of the result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / ".gpu_assets"
MODEL_DIR = ASSETS / "smollm2-awq"
WEIGHTS = "model.safetensors"
PARTS = ("part1", "part2")
MAX_PART_BYTES = 56 * 2**20  # + the repository (< 1 MiB) stays under the 64 MiB per call


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare(source: Path | None) -> None:
    """Copy the AWQ export's small files to ``.gpu_assets/smollm2-awq`` and split its weights in two.

    Args:
        source: an AWQ export folder; default the demo's cached one (quantized now if missing,
            a few minutes on a CPU).
    Raises:
        ValueError: the weights are too large for two parts.
    """
    if source is None:
        from lightinfer.cli.serve import ensure_quantized

        source = ensure_quantized()
    weights = source / WEIGHTS
    size = weights.stat().st_size
    half = (size + 1) // 2
    if half > MAX_PART_BYTES:
        raise ValueError(f"{weights} is {size / 2**20:.0f} MiB: two parts of {MAX_PART_BYTES / 2**20:.0f} MiB "
                         f"cannot carry it")
    if ASSETS.exists():
        shutil.rmtree(ASSETS)
    MODEL_DIR.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy2(f, MODEL_DIR / f.name)
    with open(weights, "rb") as src:
        for name in PARTS:
            (ASSETS / name).mkdir()
            (ASSETS / name / f"{WEIGHTS}.{name}").write_bytes(src.read(half))
    manifest = {"weights": WEIGHTS, "bytes": size, "sha256": _sha256(weights), "parts": list(PARTS)}
    (MODEL_DIR / "gpu_assets.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{MODEL_DIR} + {len(PARTS)} parts of {half / 2**20:.1f} MiB; carry them in two device calls")


def join() -> Path:
    """Concatenate the parts into ``.gpu_assets/smollm2-awq/model.safetensors`` (idempotent).

    Returns:
        The model folder.
    Raises:
        FileNotFoundError: a part or the manifest is missing (which device call was skipped?).
        ValueError: the joined file's SHA-256 differs from the manifest's.
    """
    manifest = json.loads((MODEL_DIR / "gpu_assets.json").read_text())
    target = MODEL_DIR / manifest["weights"]
    if target.is_file() and target.stat().st_size == manifest["bytes"]:
        return MODEL_DIR
    tmp = target.with_suffix(".joining")
    with open(tmp, "wb") as out:
        for name in manifest["parts"]:
            part = ASSETS / name / f"{manifest['weights']}.{name}"
            if not part.is_file():
                raise FileNotFoundError(f"{part} is missing: carry .gpu_assets/{name} in a device call first")
            out.write(part.read_bytes())
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise ValueError("the joined weights do not match the manifest's SHA-256: prepare and carry the parts again")
    tmp.rename(target)
    return MODEL_DIR


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["prepare", "join"])
    ap.add_argument("--source", type=Path, default=None, help="prepare: the AWQ folder (default: the demo's)")
    args = ap.parse_args(argv)
    if args.command == "prepare":
        prepare(args.source)
    else:
        print(join())


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
