"""The bodies of ``tests/gpu/test_new_kernels_gpu.py`` under Triton's interpreter at tiny shapes.

Those tests run only where a GPU is lent, so their code (argument names, shapes, dtypes, the engine's cache
layout, the reference calls) is first executed there unless something runs it here: this file calls the same
``check_*`` functions on CPU tensors with shapes of a few hundred elements. The kernels themselves are tested
against the reference in ``test_triton_w8a16_gemm.py`` and ``test_window_softcap.py``; what this adds is that the
GPU file's checks run, pass on correct kernels, and have a window and a cap that really change the result.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_new_kernels_gpu import (
    AttnCase,
    check_w8a16,
    check_w8a16_codes_exact,
    check_window_decode,
    check_window_prefill,
    decode_contexts,
    prefill_chunks,
)

# An audit of the GPU file's own code (the kernels' behaviour is tested elsewhere, see above), about a minute of
# interpreted attention on 2 cores: `make test-audit` / `make test-all`, not `make test`
pytestmark = pytest.mark.audit

# The interpreter's bf16 dot runs upcast (launch_utils.upcast_dot), fp16 like the GPU's: the GPU tolerances hold
W8_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}
ATTN_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}

TINY_ATTN = [
    (AttnCase("tiny-local-capped", 4, 2, 32, 24, 50.0, 20**-0.5), "fp16", torch.float16),
    (AttnCase("tiny-local-capped", 4, 2, 32, 24, 50.0, 20**-0.5), "int8", torch.float16),
    (AttnCase("tiny-local-capped", 4, 2, 32, 24, 50.0, 20**-0.5), "bf16", torch.bfloat16),
    (AttnCase("tiny-global-capped", 4, 2, 32, 0, 50.0, 32**-0.5), "int8", torch.float16),
    (AttnCase("tiny-odd-window", 4, 4, 96, 23, 0.0, 96**-0.5), "fp16", torch.float16),
]


@pytest.mark.parametrize("g,symmetric,has_bias", [(32, True, False), (16, False, True), (0, False, False)])
def test_w8a16_body(g: int, symmetric: bool, has_bias: bool) -> None:
    check_w8a16("cpu", 64, 72, g, symmetric, has_bias, [1, 20], tol=W8_TOL)


def test_w8a16_codes_exact_body() -> None:
    check_w8a16_codes_exact("cpu", 24, 64, 16)


@pytest.mark.parametrize("case,cache,dtype", TINY_ATTN, ids=lambda v: getattr(v, "name", str(v)))
def test_window_decode_body(case: AttnCase, cache: str, dtype: torch.dtype) -> None:
    check_window_decode("cpu", case, cache, dtype, decode_contexts(case.window, 24), 64, ATTN_TOL[dtype])


@pytest.mark.parametrize("case,cache,dtype", TINY_ATTN, ids=lambda v: getattr(v, "name", str(v)))
def test_window_prefill_body(case: AttnCase, cache: str, dtype: torch.dtype) -> None:
    check_window_prefill("cpu", case, cache, dtype, prefill_chunks(case.window, 24), ATTN_TOL[dtype])
