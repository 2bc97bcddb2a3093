"""Kernel benchmarks: the W4A16 GEMM, paged attention and fused MoE on a GPU (and the W4A16 tuner), the CPU
products and where a CPU decode step goes."""
