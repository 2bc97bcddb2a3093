"""The kernel switches: every ``LIGHTINFER_*`` environment variable the kernels and backends obey, read once.

Each field of :class:`KernelSwitches` carries its variable, its role and what it does (the table of
:func:`markdown_table`, which ``docs/architecture.md`` and ``kernels/README.md`` hold between
``<!-- switches:begin -->`` / ``<!-- switches:end -->``; ``tests/test_docs_switches.py`` fails when they drift,
and :func:`write_tables` rewrites them). The roles:

* ``engine``: a setting that changes an engine's results or memory. It is also an ``EngineConfig`` field and a
  CLI flag (``lightinfer.config``): the engine decides it once at start (the field, else this variable, else the
  default) and prepares its weights under it (:func:`override`), so engines built with different settings in one
  process each keep their own. The variable is the default of engines that leave the field unset, and the
  switch of kernels called outside an engine (tests, benchmarks).
* ``measure``: an A/B knob for comparing two implementations of the same result (within rounding) in tests and
  benchmarks; process-wide.
* ``build``: how the process builds its C ops (once per process): process-wide, an environment variable only.

The environment is read at the first :func:`current` call and never again: a launch costs a dict
lookup, not an ``os.environ`` read per switch. :func:`reload` re-reads it (a test or benchmark that
changes a variable in-process); :func:`override` sets switches for a ``with`` block without touching
the environment (benchmarks comparing settings in one run; an engine preparing its weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

BACKEND_ENV = "LIGHTINFER_BACKEND"
F16_DECODE_ENV = "LIGHTINFER_F16_DECODE"
PDL_ENV = "LIGHTINFER_PDL"
PDL_PREFETCH_ENV = "LIGHTINFER_PDL_PREFETCH"
W4A16_CONFIGS_ENV = "LIGHTINFER_W4A16_CONFIGS"
CPU_LOWBIT_ENV = "LIGHTINFER_CPU_LOWBIT"
CPU_NATIVE_ENV = "LIGHTINFER_CPU_NATIVE"
CPU_W4_ENV = "LIGHTINFER_CPU_W4"
CPU_AMX_ENV = "LIGHTINFER_CPU_AMX"
CPU_MARCH_ENV = "LIGHTINFER_CPU_MARCH"
BACKEND_NAMES = ("triton", "torch_cpu", "reference")
CPU_W4_NAMES = ("c", "int8", "torch")


ROLES = ("engine", "measure", "build")


def _switch(default: object, env: str, role: str, values: str, effect: str) -> object:
    """A :class:`KernelSwitches` field with its variable, role (:data:`ROLES`), the values the variable takes and
    what it does, as the docs table shows them (:func:`markdown_table`)."""
    return field(default=default, metadata={"env": env, "role": role, "values": values, "effect": effect})


@dataclass(frozen=True)
class KernelSwitches:
    """One reading of the switches (module docstring; each field's ``metadata`` holds its variable, role and effect).

    Attributes:
        backend: the forced op backend (one of :data:`BACKEND_NAMES`), or None to choose by device.
        f16_decode: fp16 activations take the fp16-pair weight decode (``w4a16_gemm.f16_decode``).
        pdl: programmatic dependent launch where the GPU and driver support it (``pdl.pdl_enabled``).
        pdl_prefetch: with PDL on, the W4 GEMMs prefetch their first weights into L2 before the wait.
        w4a16_configs: a tuned-config file path, ``"none"``, or None (the GPU model's own file).
        cpu_lowbit: on a CPU, 4-/8-bit layers with 16-bit activations stay low-bit (``cpu_lowbit.py``).
        cpu_native: on a CPU, the per-layer small ops use the C ops of ``cpu_native.py`` where they apply.
        cpu_w4: on a CPU, the product of 4-bit layers (``cpu_lowbit.py``): ``"c"`` (the C product of
            ``cpu_native``, activations int16 per block of 32), ``"int8"`` (the same, activations int8)
            or ``"torch"`` (torch's int4 GEMM, bf16 activations; also where the C library does not build).
            ``"torch"`` also keeps torch's int8 GEMM for an 8-bit LM head (else ``cpu_native.w8_linear``).
        cpu_amx: on a CPU with AMX, a 4-bit product of many rows runs on the tiles (``cpu_w4_amx.c``).
        cpu_march: the ``-march`` target of the C ops (``"native"``: this CPU).
    """

    backend: str | None = _switch(
        None, BACKEND_ENV, "measure", "`triton`, `torch_cpu`, `reference`",
        "one op backend for every tensor (unset: `triton` on CUDA, `torch_cpu` elsewhere; `lightinfer.layers.ops` "
        "decides); tests run a model's GPU path on the CPU interpreter, or the naive twins, with it")
    f16_decode: bool = _switch(
        True, F16_DECODE_ENV, "measure", "`0`",
        "tensor-core and dequant W4 kernels decode fp16 weights in fp32, not as fp16 pairs (to compare the two "
        "decodes on a GPU)")
    pdl: bool = _switch(True, PDL_ENV, "measure", "`0`", "no programmatic dependent launch (`pdl.py`)")
    pdl_prefetch: bool = _switch(True, PDL_PREFETCH_ENV, "measure", "`0`",
                                 "PDL without the W4 GEMMs' L2 prefetch of their first weights")
    w4a16_configs: str | None = _switch(
        None, W4A16_CONFIGS_ENV, "measure", "a file, `none`",
        "a tuned-config file used whatever the GPU, or `none` for the built-in launches everywhere "
        "(`w4a16_tuning.py`)")
    cpu_lowbit: bool = _switch(
        True, CPU_LOWBIT_ENV, "engine", "`0`",
        "on a CPU, 4-/8-bit layers are dequantized once into dense weights instead of staying low-bit "
        "(`cpu_lowbit.py`): the exact path, 4-8x the memory, and `dtype=\"auto\"` then means fp32. "
        "Engine setting `cpu_lowbit=False`, `--no-cpu-lowbit`")
    cpu_native: bool = _switch(
        True, CPU_NATIVE_ENV, "measure", "`0`",
        "on a CPU, norms, RoPE + KV store, decode attention and SiLU·mul run as torch ops instead of the C ops "
        "compiled at first use (`cpu_native.py`), and 4-bit layers use torch's int4 GEMM: what a machine without "
        "a C compiler runs")
    cpu_w4: str = _switch(
        "c", CPU_W4_ENV, "engine", "`c`, `int8`, `torch`",
        "on a CPU, the product of 4-bit layers (`cpu_lowbit.py`): `c` (default: the C product, activations int16 "
        "per block of 32), `int8` (the same with activations int8 per block of 32) or `torch` (torch's int4 GEMM, "
        "bf16 activations; also torch's int8 GEMM for an 8-bit LM head, which the C product takes otherwise). "
        "Engine setting `cpu_w4=`, `--cpu-w4`")
    cpu_amx: bool = _switch(
        True, CPU_AMX_ENV, "measure", "`0`",
        "on a CPU with AMX, 4-bit products of 5 rows or more (prefills, decode batches) run as without AMX "
        "instead of on its tiles: the block products below 24 rows, the weight dequantized for torch's bf16 GEMM "
        "from 24 (`cpu_native.w4_linear`); the same sums within bf16 rounding")
    cpu_march: str = _switch(
        "native", CPU_MARCH_ENV, "build", "a `-march` name",
        "the `-march` the CPU's C ops are built for (default `native`), e.g. `haswell` for an AVX2-only build on "
        "a newer CPU; the paths that need bf16 or AMX instructions then follow what that target has, not this "
        "CPU (`cpu_native.cpu_flags`)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSwitches:
        """Read the switches from ``environ``; a variable other than ``"0"`` leaves a flag on.

        Raises:
            ValueError: ``LIGHTINFER_BACKEND`` names no backend, ``LIGHTINFER_CPU_W4`` no CPU product, or
                ``LIGHTINFER_CPU_MARCH`` is not a target's name.
        """
        backend = environ.get(BACKEND_ENV) or None
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"{BACKEND_ENV}={backend!r} is not a backend; use one of {', '.join(BACKEND_NAMES)} "
                             f"or unset it (Triton on CUDA, torch_cpu elsewhere)")
        cpu_w4 = environ.get(CPU_W4_ENV) or "c"
        if cpu_w4 not in CPU_W4_NAMES:
            raise ValueError(f"{CPU_W4_ENV}={cpu_w4!r} is not a CPU 4-bit product; use one of "
                             f"{', '.join(CPU_W4_NAMES)} or unset it (c)")
        return cls(backend=backend,
                   f16_decode=environ.get(F16_DECODE_ENV, "1") != "0",
                   pdl=environ.get(PDL_ENV, "1") != "0",
                   pdl_prefetch=environ.get(PDL_PREFETCH_ENV, "1") != "0",
                   w4a16_configs=environ.get(W4A16_CONFIGS_ENV) or None,
                   cpu_lowbit=environ.get(CPU_LOWBIT_ENV, "1") != "0",
                   cpu_native=environ.get(CPU_NATIVE_ENV, "1") != "0",
                   cpu_w4=cpu_w4,
                   cpu_amx=environ.get(CPU_AMX_ENV, "1") != "0",
                   cpu_march=_march(environ.get(CPU_MARCH_ENV) or "native"))


def _march(value: str) -> str:
    """``LIGHTINFER_CPU_MARCH`` checked: it reaches a compiler's command line, so only a target's name."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", value):
        raise ValueError(f"{CPU_MARCH_ENV}={value!r} is not a -march target; use a name such as haswell, "
                         f"icelake-server, x86-64-v3, or unset it (native)")
    return value


_current: KernelSwitches | None = None


def current() -> KernelSwitches:
    """The switches in force: the environment as first read (see :func:`reload`, :func:`override`).

    Raises:
        ValueError: from :meth:`KernelSwitches.from_env` on a bad ``LIGHTINFER_BACKEND``.
    """
    global _current
    if _current is None:
        _current = KernelSwitches.from_env()
    return _current


def reload() -> KernelSwitches:
    """Read the environment again (after a test or benchmark changed it) and return the new switches."""
    global _current
    _current = None
    return current()


@contextlib.contextmanager
def override(**changes: object) -> Iterator[KernelSwitches]:
    """Inside the block the switches are :func:`current`'s with ``changes`` (field names of
    :class:`KernelSwitches`); afterwards the previous ones. Not thread-safe (one module-level value).

    Raises:
        TypeError: a name that is not a switch.
        ValueError: a backend that is not one of :data:`BACKEND_NAMES`, a ``cpu_w4`` not one of :data:`CPU_W4_NAMES`.
    """
    global _current
    previous = current()
    if changes.get("backend") not in (None, *BACKEND_NAMES):
        raise ValueError(f"backend {changes['backend']!r} is not one of {', '.join(BACKEND_NAMES)}")
    if "cpu_w4" in changes and changes["cpu_w4"] not in CPU_W4_NAMES:
        raise ValueError(f"cpu_w4 {changes['cpu_w4']!r} is not one of {', '.join(CPU_W4_NAMES)}")
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous


def engine_switches() -> tuple[str, ...]:
    """The names of the switches whose role is ``engine`` (module docstring): each is an ``EngineConfig`` field of
    the same name, which an engine resolves and applies with :func:`override` while it prepares its weights."""
    return tuple(f.name for f in fields(KernelSwitches) if f.metadata["role"] == "engine")


TABLE_BEGIN = "<!-- switches:begin (generated by lightinfer.kernels.switches.markdown_table; do not edit) -->"
TABLE_END = "<!-- switches:end -->"


def markdown_table() -> str:
    """The switches as a Markdown table, one row per field of :class:`KernelSwitches` in declaration order:
    variable, values, role, effect (from the fields' ``metadata``). No trailing newline."""
    rows = ["| variable | values | role | effect |", "|---|---|---|---|"]
    for f in fields(KernelSwitches):
        m = f.metadata
        rows.append(f"| `{m['env']}` | {m['values']} | {m['role']} | {m['effect']} |")
    return "\n".join(rows)


def replace_table(text: str) -> str:
    """``text`` with what lies between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced by :func:`markdown_table`.

    Raises:
        ValueError: ``text`` lacks the two markers, in that order.
    """
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"no {TABLE_BEGIN!r} ... {TABLE_END!r} block to fill")
    return text[: start + len(TABLE_BEGIN)] + "\n" + markdown_table() + "\n" + text[end:]


def write_tables(paths: list[str]) -> list[str]:
    """Rewrite the switches table in each Markdown file of ``paths`` (:func:`replace_table`); returns the paths
    that changed. ``python -c "from lightinfer.kernels import switches; switches.write_tables(['docs/architecture.md',
    'kernels/README.md'])"`` after a switch changes.

    Raises:
        ValueError: a file without the markers. OSError: a file that cannot be read or written.
    """
    changed = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = replace_table(text)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            changed.append(path)
    return changed
