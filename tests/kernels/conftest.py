"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

Triton decides at decoration time (``@triton.jit``, i.e. when a kernel module is imported)
whether kernels are interpreted, so the variable must be set before anything imports triton;
the Makefile sets it for the whole run, this covers ``pytest tests/kernels`` run by hand.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default-change warning
