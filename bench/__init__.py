"""lightinfer's benchmarks, grouped by what they measure (``bench/README.md`` maps them).

Run each from the checkout root as a module, e.g. ``python -m bench.serving.peer_serving --run``; the
code they share (server processes, the load client, /proc readings, result files) is :mod:`bench.common`.
"""
