"""mllmd_kernels' environment switches: every MLLMD_* variable the kernel library reads, read here.

Each is a function that reads the environment when called; the modules that use a switch say when
they call it (once per process for most, through their caches). Unset and empty mean the default.

| variable | default | effect | read by |
|---|---|---|---|
| MLLMD_PDL | on | `0`: no programmatic dependent launch in the decode CUDA graphs (for comparison) | `_triton.pdl_supported` (once per device) |
| MLLMD_INT8_TMA_MIN_ROWS | 1024 | rows from which sm90 runs the W8A8 prefill GEMM with TMA loads (a large value turns it off) | `int8_config.TMA_MIN_ROWS` (at import) |
| MLLMD_W4A16_TUNED | unset | a JSON file of one-row W4A16 gemv tilings by (N, K), as `bench_quant --w4a16-tuned-out` writes | `w4a16_config.tuned_gemv_configs` (once) |
| MLLMD_W4A16_MMA_TUNED | unset | a JSON file of CUDA W4A16 launch splits {"N,K": [split, warps]} | `w4a16_mma.tuned_configs` (once) |
| MLLMD_W4A16_PLANES | on | `0`: the W4A16 tensor-core tilings (2+ rows) dequantize in float32 even where the scales are values of the activations' dtype (where they are, the default builds the weight tile from its nibble planes in packed 16-bit PTX: the same bits, faster) | `w4a16_dequant.dequant_mode` (every launch) |
| MLLMD_CUDA_KERNELS | auto | `0` / `off` / `false` / `no`: never build or use the CUDA W4A16 kernel | `w4a16_mma` (once per architecture) |
| MLLMD_NVCC | unset | the CUDA compiler to build it with (before $CUDA_HOME/bin/nvcc, PATH, /usr/local/cuda) | `cuda_build.find_nvcc` |
| MLLMD_KERNEL_CACHE | unset | where built CUDA libraries are kept (else $XDG_CACHE_HOME/mllmd/cuda) | `cuda_build.cache_dir` |
| MLLMD_BENCH_SMOKE | off | `1`: the micro-benchmarks run tiny shapes on the CPU (under TRITON_INTERPRET=1) | `bench.common.SMOKE` (at import) |

Variables that belong to other tools are read where they are used, as those tools define them:
TRITON_INTERPRET (`_triton.interpreting`), CUDA_HOME / CUDA_PATH / XDG_CACHE_HOME (`cuda_build`).
"""

from __future__ import annotations

import os


def _get(name: str) -> str | None:
    return os.environ.get(name) or None


def pdl_enabled() -> bool:
    """MLLMD_PDL: programmatic dependent launch where the GPU supports it, unless `0`."""
    return os.environ.get("MLLMD_PDL", "1") != "0"


def int8_tma_min_rows() -> int:
    """MLLMD_INT8_TMA_MIN_ROWS: the W8A8 prefill GEMM's TMA tiling from this many rows (sm90+)."""
    return int(os.environ.get("MLLMD_INT8_TMA_MIN_ROWS", "1024"))


def w4a16_tuned_path() -> str | None:
    """MLLMD_W4A16_TUNED: the one-row W4A16 gemv tilings file, or None."""
    return _get("MLLMD_W4A16_TUNED")


def w4a16_mma_tuned_path() -> str | None:
    """MLLMD_W4A16_MMA_TUNED: the CUDA W4A16 kernel's launch splits file, or None."""
    return _get("MLLMD_W4A16_MMA_TUNED")


def w4a16_planes() -> bool:
    """MLLMD_W4A16_PLANES: the W4A16 tensor-core tilings may dequantize from the nibble planes, unless `0`."""
    return os.environ.get("MLLMD_W4A16_PLANES", "1") != "0"


def cuda_kernels_enabled() -> bool:
    """MLLMD_CUDA_KERNELS: the CUDA W4A16 kernel may be built and used, unless 0 / off / false / no."""
    return os.environ.get("MLLMD_CUDA_KERNELS", "auto").lower() not in ("0", "off", "false", "no")


def nvcc() -> str | None:
    """MLLMD_NVCC: the CUDA compiler to try first, or None."""
    return _get("MLLMD_NVCC")


def kernel_cache() -> str | None:
    """MLLMD_KERNEL_CACHE: the folder for built CUDA libraries, or None (the XDG cache)."""
    return _get("MLLMD_KERNEL_CACHE")


def bench_smoke() -> bool:
    """MLLMD_BENCH_SMOKE: `1` runs the micro-benchmarks' tiny CPU shapes."""
    return os.environ.get("MLLMD_BENCH_SMOKE") == "1"
