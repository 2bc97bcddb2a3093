"""The act-order test runs a W4 kernel on Triton's CPU interpreter: set the variable before anything
imports triton (the Makefile sets it for the whole run; this covers ``pytest tests/formats``)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
