"""When the model layers call mllmd_kernels' Triton kernels instead of plain torch ops.

On CUDA with Triton installed the fused kernels are the default (they compute the same function as
the torch code: see each kernel's reference and tests). `MLLMD_DISABLE_FUSED_KERNELS=1` turns them off,
for comparisons and for bisecting a numerical difference (read once, when the process imports this).
"""

from __future__ import annotations

import torch
from mllmd_kernels._triton import use_triton

from mllmd import knobs

# Rows up to which a dense projection uses the Triton GEMV instead of cuBLAS. At one row it reads
# the weights 2-27% faster than cuBLAS on the Qwen3-8B projections (H200); from two rows on the two
# are within about 10% of each other either way (kernels/mllmd_kernels/bench/h200_results.jsonl).
GEMV_MAX_ROWS = 1


# Read once: these checks run for every layer of every eager step.
_DISABLED = knobs.DISABLE_FUSED_KERNELS


def fused_kernels(x: torch.Tensor) -> bool:
    """Use the Triton RMSNorm / RoPE / SiLU-and-mul kernels on tensors like `x`."""
    return not _DISABLED and use_triton(x)


def use_gemv(x: torch.Tensor) -> bool:
    """Use the Triton GEMV for x @ W^T (x [M, K] with M <= GEMV_MAX_ROWS, K-contiguous)."""
    return x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.stride(-1) == 1 and fused_kernels(x)
