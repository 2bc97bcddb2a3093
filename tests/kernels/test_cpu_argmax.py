"""The sampler's greedy pick in C (``native/cpu_sample.c``): torch.argmax's answer, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

from lightinfer.kernels import cpu_native
from lightinfer.layers.sampler import greedy_pick

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="the C ops do not build here")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152, 151_937])
def test_argmax_rows_equals_torch(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=gen)
    x[1] = -float("inf")  # all -inf: index 0
    x[2, n // 2] = float("inf")
    if n > 3:
        x[3, [n - 1, 1]] = 1e4  # a tie: the first
        x[4, n - 2] = float("nan")  # NaN wins, as in torch
        x[4, 0] = float("nan")
    x[5] = 0.0  # all equal
    got = cpu_native.argmax_rows(x)
    assert got is not None and got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_rows_declines_what_it_does_not_handle() -> None:
    assert cpu_native.argmax_rows(torch.randn(2, 8).bfloat16()) is None
    assert cpu_native.argmax_rows(torch.randn(8, 2).t()) is None  # not contiguous
    assert cpu_native.argmax_rows(torch.randn(8)) is None


def test_greedy_pick_falls_back_to_torch() -> None:
    x = torch.randn(8, 3).t()  # strided: the torch path
    assert greedy_pick(x).tolist() == x.argmax(dim=-1).tolist()
    y = torch.randn(4, 100)
    assert greedy_pick(y).tolist() == y.argmax(dim=-1).tolist()
