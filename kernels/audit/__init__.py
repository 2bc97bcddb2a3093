"""Build-time audits of the kernels, run without a GPU: each compiles the launchers' configurations for a GPU
target and reads the machine code.

* ``python -m lightinfer.kernels.audit.smem_check [--arch 86]``: shared memory, registers and spills of
  every configuration against a card's limits.
* ``python -m lightinfer.kernels.audit.sass_stats [--arch 90]``: instructions per weight / cache byte in
  the hot loops of the decode-path kernels.
* ``python -m lightinfer.kernels.audit.pdl_check``: every kernel waits before it touches memory under
  programmatic dependent launch.

This package imports the kernels; no kernel module imports it (``tests/kernels/test_boundaries.py``).
"""
