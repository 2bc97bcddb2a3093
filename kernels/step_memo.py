"""What every layer of a CPU decode step shares: values derived from the step's own tensors, built once.

Used by the ``torch_cpu`` small ops (``cpu_fused.py``: the RoPE table rows and the checked slots) and by
the C ops' range checks (``cpu_native.py``); its own module so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StepMemo:
    """One cached value per kind, reused while its key tensors are the very same objects, unmodified.

    Every layer of a step calls an op with the step's own ``positions`` / ``slot_mapping`` tensors (the
    engine makes them fresh each step), so a value derived from them is computed by the first layer and
    reused by the others. The entry holds the key tensors, so their identities cannot be recycled while
    cached; in-place changes are caught by the tensors' version counters (inference tensors have none,
    and the engine never modifies them in place).
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[torch.Tensor, ...], tuple, Any]] = {}  # kind -> (keys, versions, value)

    def get(self, kind: str, tensors: tuple[torch.Tensor, ...], extra: tuple, build: Callable[[], Any]) -> Any:
        """The value cached for ``kind`` if it was built from these very tensors (unmodified) and ``extra``,
        else ``build()`` (then cached)."""
        hit = self._entries.get(kind)
        if hit is not None:
            keys, versions, value = hit
            if len(keys) == len(tensors) and all(a is b for a, b in zip(keys, tensors)) and \
                    versions == _versions(tensors, extra):
                return value
        value = build()
        self._entries[kind] = (tensors, _versions(tensors, extra), value)
        return value


def _versions(tensors: tuple[torch.Tensor, ...], extra: tuple) -> tuple:
    return (*(-1 if t.is_inference() else t._version for t in tensors), *extra)


step_memo = StepMemo()  # the process's one memo: what every layer of the current step shares
