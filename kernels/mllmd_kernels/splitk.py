"""splitk: split-K for the decode GEMMs (gemv, the int8 and W4A16 decode tilings), written once.

A projection of a few rows has too few output tiles to keep every SM busy, so its K loop is split
over a second grid axis: program (n, s) sums columns [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) of
output tile n and stores its partial sums into part [SPLIT_K, M, N] (float32; int32 for int8, whose
sums are exact). The partials are then added in split order, so the result does not depend on
which program finished first (deterministic, no atomics on the outputs, no memset):
* `splitk_reduce`, a second launch (and the int8 epilogue: the scales, then the bias);
* or, where the caller owns a set of arrival counters (the W4A16 kernels), by the last program of
  each tile to arrive (`splitk_store` with SERIAL), which saves that launch.

On the host: `auto_split` picks how many splits, `k_splits` how many columns each takes.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton


def auto_split(
    tiles: int, k: int, block_k: int, num_sms: int, ctas_per_sm: int = 2, min_blocks: int = 4
) -> int:
    """Split K (powers of two) until there are about `ctas_per_sm` tiles per SM, keeping at least
    `min_blocks` K-blocks per split."""
    split = 1
    while tiles * split * 2 <= ctas_per_sm * num_sms and k // (split * 2) >= min_blocks * block_k:
        split *= 2
    return split


def k_splits(k: int, split_k: int, step: int) -> tuple[int, int]:
    """(columns per split, a multiple of `step`, the kernel's K step; the number of splits, at most
    split_k: the last one may be shorter)."""
    k_per_split = cdiv(cdiv(k, split_k), step) * step
    return k_per_split, cdiv(k, k_per_split)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32, or int32 (SCALED)
    as_ptr,  # [M] float32 (SCALED)
    bs_ptr,  # [N] float32 (SCALED)
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    stride_ym,
    SPLIT_K,
    SCALED: tl.constexpr,  # int8: y = float32(sum) * a_scale[m] * b_scale[n] (+ bias)
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round the result to bf16 / fp16 before storing (gemv: x's dtype,
    ROUND_FP16: tl.constexpr,  # where y is float32)
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=part_ptr.dtype.element_ty)
    for s in range(0, SPLIT_K):  # fixed order: deterministic (integer sums: exact in any order)
        acc += tl.load(part_ptr + s * M * N + m * N + offs, mask=mask, other=0)
    if SCALED:
        out = acc.to(tl.float32) * tl.load(as_ptr + m) * tl.load(bs_ptr + offs, mask=mask, other=0.0)
    else:
        out = acc
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ROUND_BF16:
        out = out.to(tl.bfloat16).to(tl.float32)
    if ROUND_FP16:
        out = out.to(tl.float16).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def splitk_reduce(
    part: torch.Tensor,  # [SPLIT_K, M, N] float32, or int32 with the scales
    out: torch.Tensor,  # [M, N], unit last stride
    bias: torch.Tensor | None = None,  # [N]
    a_scale: torch.Tensor | None = None,  # [M] float32: int32 partials, scaled as int8_gemm's epilogue
    b_scale: torch.Tensor | None = None,  # [N] float32
    round_to: torch.dtype | None = None,  # bf16 / fp16: round the sums to it before storing in `out`
) -> torch.Tensor:
    """out = the partials added in split order (then scaled, then + bias, then rounded: as given)."""
    split, m, n = part.shape
    scaled = a_scale is not None
    assert scaled == (b_scale is not None) == (part.dtype == torch.int32), "int32 partials take both scales"
    block = min(1024, next_pow2(n))
    _splitk_reduce_kernel[(cdiv(n, block), m)](
        part, a_scale if scaled else part, b_scale if scaled else part, bias if bias is not None else part, out,
        m, n, out.stride(0), split, SCALED=scaled, HAS_BIAS=bias is not None,
        ROUND_BF16=round_to == torch.bfloat16, ROUND_FP16=round_to == torch.float16, BLOCK=block,
        **pdl_args(part),
    )  # fmt: skip
    return out


@triton.jit
def splitk_store(
    value,  # float32 partial of this program's K split
    part_ptrs,  # where split 0's partial of these outputs goes ([SPLIT_K, M, N] float32)
    split_stride,  # M * N
    mask,
    y_ptrs,  # the outputs
    bias_ptrs,  # their biases (HAS_BIAS)
    lock_ptr,  # this output tile's arrival counter (int32, 0 between launches)
    SPLIT_K,
    HAS_BIAS: tl.constexpr,
    SERIAL: tl.constexpr,
):
    """Store this split's partial (program_id(1) is the split); with SERIAL, the tile's last program to
    arrive adds all SPLIT_K partials in split order (deterministic, whichever program is last), writes
    the output and resets the counter, so no reduce launch follows. The barrier and the acq_rel
    atomic publish the program's partial before it counts; the winner reads the others' from L2 (.cg)."""
    pid_k = tl.program_id(1)
    tl.store(part_ptrs + pid_k * split_stride, value, mask=mask)
    if SERIAL:
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros_like(value)
            for s in range(0, SPLIT_K):  # fixed order
                acc += tl.load(part_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr, 0)
