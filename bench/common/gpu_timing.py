"""GPU timing shared by the kernel benchmarks: CUDA-graph replays over data that rotates past the L2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

ROTATE_BYTES = 256 << 20  # > 4x the 50-60 MB L2 of an H100/H200


def bench_us(fn: Callable[[], Any], quick: bool, calls: int = 1) -> float:
    """GPU time of one of the ``calls`` launches that ``fn`` makes, in µs (median).

    Timed by replaying ``fn`` in a CUDA graph (triton's ``do_bench_cudagraph``): eager timing of
    10-50 µs kernels measures Python launch overhead, not the kernel. Callers make ``fn`` cycle
    over several copies of the data (``calls`` of them) so that nothing is served from L2.
    """
    import triton.testing

    try:
        t = triton.testing.do_bench_cudagraph(fn, rep=20 if quick else 100, return_mode="median")
    except Exception as e:  # noqa: BLE001 - capture failed (e.g. a host sync): fall back to eager timing
        print(f"warning: CUDA-graph timing failed ({str(e).splitlines()[0][:160]}); timing eagerly (launch "
              f"overhead included)", file=sys.stderr, flush=True)
        t = triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")
    return float(t) * 1e3 / calls


def copies_for(nbytes: int) -> int:
    """Copies of a ``nbytes`` working set that together exceed the L2 several times (at most 64)."""
    return max(1, min(64, -(-ROTATE_BYTES // max(1, nbytes))))


def copy_bandwidth(quick: bool) -> dict[str, float]:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    import triton.testing

    # eager timing: a 1 GiB copy runs ~0.5 ms, far above launch overhead
    us = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=5 if quick else 25, rep=50 if quick else 200,
                                       return_mode="median")) * 1e3
    return {"bytes": 2 * src.numel(), "us": us, "GBps": 2 * src.numel() / us / 1e3}
