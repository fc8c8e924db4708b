"""gemv: decode GEMV / skinny GEMM y = x W^T for a few rows of x (batch 1..64), bf16/fp16/fp32.

At decode batch sizes a projection is bound by reading W once. These kernels tile W along N (its
rows) and optionally split K so that every SM has several weight tiles in flight:

* BLOCK_M in 1, 2, 4, 8: `_gemv_kernel` multiplies [BLOCK_N, BLOCK_K] weight tiles by the rows of x
  in fp32 registers and reduces over K once at the end (no shared memory, no tensor cores); on an
  H200 it beats the tensor-core path only for a single row, so `pick_gemv_config` uses it for M == 1;
* BLOCK_M >= 16 (the default for M >= 2): `_skinny_gemm_kernel` computes acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T
  on tensor cores (W is the 64-row operand, x padded to BLOCK_M rows);
* split_k > 1 writes fp32 partial sums [SPLIT_K, M, N] that `splitk_reduce` adds in a fixed
  order (deterministic, no atomics, no memset).

No host synchronisation: the launch depends only on shapes, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mllmd_kernels._triton import cdiv, dot_in_fp32, next_pow2, pdl_args, pdl_sync, sm_count_for, tl, triton
from mllmd_kernels.splitk import auto_split, k_splits, splitk_reduce


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype (fp32 accumulation)."""
    return (x.float() @ weight.float().t()).to(x.dtype)


@dataclass(frozen=True)
class GemvConfig:
    block_m: int  # 1, 2, 4, 8 (fp32 FMA path) or >= 16 (tensor cores)
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


@triton.jit
def store_row(acc, x_dtype: tl.constexpr, y_ptr, part_ptr, offs_n, mask_n, pid_k, N, IS_SPLIT: tl.constexpr):
    """One row's outputs from acc [BLOCK_N, BLOCK_K]: summed over K, rounded to x's dtype into y (a
    float32 y holds exactly those values), or this K split's float32 partials into part [split, N]."""
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not IS_SPLIT:
        tl.store(y_ptr + offs_n, y.to(x_dtype).to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, y, mask=mask_n)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    y_ptr,  # [M, N] (not IS_SPLIT)
    part_ptr,  # [split_k, M, N] fp32 (IS_SPLIT)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    K_PER_SPLIT,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Up to 8 rows of x: fp32 multiply-accumulate over [BLOCK_N, BLOCK_K] weight tiles, one reduction
    over K at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)  # out-of-range rows re-read row 0 (unmasked loads)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_len = tl.minimum(K_PER_SPLIT, K - k_start)
    pdl_sync(USE_PDL)
    num_iters = tl.cdiv(k_len, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    if BLOCK_M == 1:
        x_ptrs = x_ptr + k_start + offs_k  # [BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for it in range(0, num_iters):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs)
            else:
                k_mask = (it * BLOCK_K + offs_k) < k_len
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        store_row(acc, x_ptr.dtype.element_ty, y_ptr, part_ptr, offs_n, mask_n, pid_k, N, IS_SPLIT)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for it in range(0, num_iters):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            else:
                k_mask = (it * BLOCK_K + offs_k) < k_len
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=mask_m[:, None] & k_mask[None, :], other=0.0)
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        ym = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
        out_mask = mask_m[:, None] & mask_n[None, :]
        if not IS_SPLIT:
            y = ym.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)  # rounded to x's dtype first (float32 out)
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask)
        else:
            tl.store(part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], ym, mask=out_mask)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    y_ptr,  # [M, N] (not IS_SPLIT)
    part_ptr,  # [split_k, M, N] fp32 (IS_SPLIT)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    K_PER_SPLIT,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """2..64 rows of x: acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T on tensor cores (x padded to 16+ rows)."""
    pdl_sync(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    mask_m = offs_m < M
    rows_m = tl.where(mask_m, offs_m, 0).to(tl.int64)  # padding rows re-read row 0 (never stored)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_len = tl.minimum(K_PER_SPLIT, K - k_start)
    num_iters = tl.cdiv(k_len, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(0, num_iters):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            k_mask = (it * BLOCK_K + offs_k) < k_len
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = mask_n[:, None] & mask_m[None, :]
    if not IS_SPLIT:
        y = acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)  # rounded to x's dtype first (float32 out)
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=out_mask)
    else:
        tl.store(part_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


def pick_gemv_config(m: int, n: int, k: int, num_sms: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """Tile sizes for x[m, k] @ W[n, k]^T (from H200 sweeps over the projections of Qwen3-8B, Qwen3.5-9B,
    Qwen3-VL-2B and Qwen3.5-2B: `bench_gemv --sweep-m 1 --config ...`)."""
    if m == 1:
        if n * k >= 1 << 24 and (k >= 8192 or n <= 4096):  # 8B / 9B down, o: 32+ MB in long rows or few of them
            cfg = GemvConfig(1, 16, 1024, 1, 8, 1)
        else:  # the rest, and every projection of the 2B models (16-row tiles cost them 10-15%)
            cfg = GemvConfig(1, 4, 1024, 1, 4, 1)
    elif m <= 32:  # tensor cores beat the FMA path from 2 rows on (H200 sweep, M = 2..32)
        cfg = GemvConfig(max(16, next_pow2(m)), 64, 128, 1, 4, 4)
    else:
        cfg = GemvConfig(next_pow2(m), 64, 64, 1, 4, 5)
    if dtype == torch.float32 and cfg.use_dot:  # twice the bytes per element: halve the K tile
        cfg = GemvConfig(cfg.block_m, cfg.block_n, cfg.block_k // 2, 1, cfg.num_warps, min(cfg.num_stages, 3))
    return with_auto_split(cfg, n, k, num_sms)


def with_auto_split(cfg: GemvConfig, n: int, k: int, num_sms: int) -> GemvConfig:
    """Split K until there are about two tiles per SM (never below 4 K-blocks per split)."""
    return replace(cfg, split_k=auto_split(cdiv(n, cfg.block_n), k, cfg.block_k, num_sms))


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    out: torch.Tensor | None = None,  # [M, N], x's dtype or float32
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """y = x @ weight^T for small M (1..64; use cuBLAS beyond) with Triton; fp32 accumulation, output
    in x's dtype, or in a float32 `out` holding exactly those values (gemv(x, w).float() without the
    copy: the decode step's logits)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    assert x.stride(1) == 1 and weight.stride(1) == 1, "gemv needs K-contiguous x and weight"
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.dtype in (x.dtype, torch.float32) and out.shape == (m, n) and out.stride(1) == 1
    if m == 0:
        return out
    cfg = config or pick_gemv_config(m, n, k, sm_count_for(x), x.dtype)
    assert cfg.block_m >= m, f"block_m {cfg.block_m} < {m} rows"
    k_per_split, split = k_splits(k, cfg.split_k, cfg.block_k)
    even_k = k % cfg.block_k == 0
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (cdiv(n, cfg.block_n), split)
    if cfg.use_dot:
        _skinny_gemm_kernel[grid](
            x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=split > 1,
            DOT_F32=dot_in_fp32(x.dtype), EVEN_K=even_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_args(x),
        )
    else:
        _gemv_kernel[grid](
            x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=split > 1, EVEN_K=even_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_args(x),
        )
    if split > 1:  # rounded to x's dtype first (float32 out)
        splitk_reduce(part, out, round_to=x.dtype)
    return out
