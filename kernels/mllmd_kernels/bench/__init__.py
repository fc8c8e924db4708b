"""Kernel micro-benchmarks (CUDA only): each kernel against its torch / cuBLAS counterpart.

`python -m mllmd_kernels.bench.run_all` prints one JSON line per case and a table last.
"""
