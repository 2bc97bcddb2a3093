"""Tuned W4A16 GEMM launches per GPU model: the measured answer to "which path, tile and split-K for this shape".

The launcher's built-in choices (:data:`w4a16_gemm.GEMV_CONFIGS`, :data:`w4a16_gemm.TILED_CONFIGS`, the
``GEMV_MAX_M`` / ``TILED_MAX_M`` crossovers, the split-K heuristic) are one setting per group size for
every shape and GPU. ``bench/kernels/tune_w4a16.py`` times the candidates on a GPU, shape by shape and M by M,
and writes the winners to ``kernels/configs/w4a16_<device>.json`` (vLLM ships tuned Triton configs per
device the same way, e.g. its fused-MoE ``configs/``). :func:`tuned_launch` reads that file for the GPU
it runs on; shapes and GPUs without an entry keep the built-in choices.

File format (JSON)::

    {"device": "NVIDIA H200", "triton": "3.6.0", "torch": "...", "time": "...",
     "entries": {"N=12288,K=4096,G=128": {"1": {"path": "gemv", "block_m": 1, "block_n": 128,
                                                "block_k": 128, "num_warps": 4, "num_stages": 3,
                                                "split_k": 6, "us": 12.1, "default_us": 20.3}, ...}}}

An entry keyed ``"M"`` serves every M above the next smaller key, up to M; above the largest key the
built-in choice serves. ``us`` / ``default_us`` (the built-in choice in the same run) are informational.
Launches are timed with integer zero points and serve fractional ones as well: ``integer_zeros`` picks the
decode inside the kernels, never the launch.

``LIGHTINFER_W4A16_CONFIGS`` (``switches.py``) overrides the lookup: a path to one such file (used whatever
the device, the CPU interpreter included: tests), or ``none`` to use the built-in choices everywhere
(benchmarks compare the two in one run that way).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import switches

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PATHS = ("gemv", "tiled", "swap_ab", "dequant")
_LAUNCH_FIELDS = ("path", "block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k")


@dataclass(frozen=True)
class W4Launch:
    """How one W4A16 GEMM is launched.

    Attributes:
        path: ``"gemv"`` (FFMA, split-K), ``"tiled"`` (tensor cores), ``"swap_ab"`` (tensor cores, weights
            as the A operand: :mod:`.w4a16_tiled`) or ``"dequant"`` (dequantize + cuBLAS; the other
            fields are unused).
        block_m: rows of x per program (gemv: the launcher uses ``next_pow2(M)`` whatever is stored).
        block_n: output columns (weight rows) per program.
        block_k: K per loop step (gemv: the group size; tiled: a divisor of it, >= 16).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the K loop.
        split_k: K splits (programs per output tile); 0 = the launcher's heuristic.
    """

    path: str
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 0


def shape_key(n: int, k: int, group_size: int) -> str:
    """The ``entries`` key of a ``[K, N]`` weight with groups of ``group_size``."""
    return f"N={n},K={k},G={group_size}"


def device_file(device_name: str) -> Path:
    """``kernels/configs/w4a16_<name>.json`` for a ``torch.cuda.get_device_name()`` string."""
    return CONFIG_DIR / f"w4a16_{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}.json"


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_launch(launch: W4Launch, group_size: int) -> None:
    """Raise ValueError unless the kernels can run ``launch`` for weights with groups of ``group_size``."""
    if launch.path not in PATHS:
        raise ValueError(f"path {launch.path!r} is not one of {PATHS}")
    if launch.path == "dequant":
        return
    fields = {"block_m": launch.block_m, "block_n": launch.block_n, "block_k": launch.block_k,
              "num_warps": launch.num_warps}
    bad = {k: v for k, v in fields.items() if not isinstance(v, int) or not _is_pow2(v)}
    if bad:
        raise ValueError(f"{bad} must be powers of two (Triton block shapes and warp counts)")
    if not isinstance(launch.num_stages, int) or launch.num_stages < 1:
        raise ValueError(f"num_stages={launch.num_stages!r} must be an integer >= 1")
    if not isinstance(launch.split_k, int) or launch.split_k < 0:
        raise ValueError(f"split_k={launch.split_k!r} must be an integer >= 0 (0: the launcher's heuristic)")
    if launch.path == "gemv" and launch.block_k != group_size:
        raise ValueError(f"the gemv path steps one group at a time: block_k must be {group_size}, got {launch.block_k}")
    if launch.path in ("tiled", "swap_ab") and (group_size % launch.block_k
                                                or min(launch.block_m, launch.block_n, launch.block_k) < 16):
        raise ValueError(f"the {launch.path} path needs block_m, block_n, block_k >= 16 (tl.dot) and block_k "
                         f"dividing the group size {group_size}; got {launch.block_m}/{launch.block_n}/{launch.block_k}")


def parse_file(path: Path) -> dict[str, list[tuple[int, W4Launch]]]:
    """A tuned-config file -> ``{shape_key: [(M, launch), ...] sorted by M}``, every launch checked.

    Raises:
        ValueError: naming the file and entry that is not valid JSON of the format in the module docstring.
    """
    try:
        data = json.loads(Path(path).read_text())
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise TypeError("'entries' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a W4A16 tuned-config file ({e}); regenerate it with bench/kernels/tune_w4a16.py "
                         f"or unset {switches.W4A16_CONFIGS_ENV}") from e
    table: dict[str, list[tuple[int, W4Launch]]] = {}
    for key, by_m in entries.items():
        match = re.fullmatch(r"N=(\d+),K=(\d+),G=(\d+)", key)
        if match is None or not isinstance(by_m, dict):
            raise ValueError(f"{path}: entry {key!r} must be 'N=<int>,K=<int>,G=<int>' -> {{M: launch}}")
        rows = []
        for m, spec in by_m.items():
            try:
                launch = W4Launch(**{f: spec[f] for f in _LAUNCH_FIELDS if f in spec})
                check_launch(launch, int(match.group(3)))
                rows.append((int(m), launch))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: entry {key} M={m}: {e}") from e
        table[key] = sorted(rows, key=lambda r: r[0])
    return table


def launch_record(launch: W4Launch, **extra: Any) -> dict[str, Any]:
    """One file entry: the launch's fields plus ``extra`` (e.g. ``us``, ``default_us``)."""
    return {**asdict(launch), **extra}


_TABLES: dict[str, dict[str, list[tuple[int, W4Launch]]]] = {}  # file -> parsed table
# (override, device type, index, shape key) -> (sorted Ms, launches): the launcher asks on every call
_LOOKUP: dict[tuple, tuple[list[int], list[W4Launch]]] = {}


def _table_for(device: torch.device, override: str | None) -> dict[str, list[tuple[int, W4Launch]]]:
    if override is not None and override.lower() == "none":
        return {}
    if override:
        path = Path(override)
    elif device.type == "cuda":
        path = device_file(torch.cuda.get_device_name(device))
    else:
        return {}
    key = str(path)
    if key not in _TABLES:  # read once per process; a missing device file is an untuned GPU, not an error
        _TABLES[key] = parse_file(path) if path.exists() or override else {}
    return _TABLES[key]


def tuned_launch(device: torch.device, m: int, n: int, k: int, group_size: int) -> W4Launch | None:
    """The measured launch for ``M = m`` rows on this weight shape and device, or None (untuned).

    Raises:
        ValueError: the device's file (or ``LIGHTINFER_W4A16_CONFIGS``'s) is malformed.
    """
    override = switches.current().w4a16_configs
    memo = (override, device.type, device.index, n, k, group_size)
    found = _LOOKUP.get(memo)
    if found is None:
        rows = _table_for(device, override).get(shape_key(n, k, group_size), [])
        found = _LOOKUP[memo] = ([r[0] for r in rows], [r[1] for r in rows])
    ms, launches = found
    i = bisect.bisect_left(ms, m)
    # Above the largest tuned M: untuned (a tuning run cut short must not hand a decode-sized tile to a prefill).
    return launches[i] if i < len(ms) else None


def clear_cache() -> None:
    """Forget parsed files (tests that change ``LIGHTINFER_W4A16_CONFIGS`` or write files)."""
    _TABLES.clear()
    _LOOKUP.clear()
