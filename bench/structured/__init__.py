"""Structured-output benchmarks: what a JSON schema costs the engine (``structured_cpu``), and the cases the
grammar library was chosen on (``cases``, which tests/structured/ reuses)."""
