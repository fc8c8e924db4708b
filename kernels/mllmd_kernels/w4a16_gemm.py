"""w4a16_gemm: y = x W^T with int4 weights dequantized inside the kernel (compressed-tensors W4A16,
the format of `w4a16_dequant`).

The tilings are `w4a16_config`'s: one row runs `w4a16_gemv`'s kernel; 2..64 rows the "skinny"
tensor-core tiling and prefills the "gemm" one, both on the weight tile widened in registers
(`_dequant_f32`) and rounded to the activation dtype; long prefills dequantize once instead
(`w4a16_dequantize` + cuBLAS, where `prefers_dequant`).
"gemv" and "skinny" split K until every SM has a few tiles, writing float32 partials
[SPLIT_K, M, N] that are added in a fixed split order (deterministic): given the layer's counters
(`splitk_counters`), by the last program of each output tile to finish (one atomic per program, no
second launch); otherwise by `splitk_reduce`.
The weight dequantized for the tensor-core paths equals the reference's bit for bit on the GPU
(the gemv path keeps it in float32, which is slightly more accurate); sums differ by order only.

No host synchronisation: the launches depend only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, dot_in_fp32, pdl_args, pdl_sync, sm_count_for, tl, triton
from mllmd_kernels.splitk import k_splits, splitk_reduce, splitk_store
from mllmd_kernels.tiling import max_shared_memory, n_tile_k_split, swizzled_tile
from mllmd_kernels.w4a16_config import W4A16Config, group_block_k, pick_w4a16_config
from mllmd_kernels.w4a16_dequant import (
    SCALE_DTYPES,
    _check_mma_order,
    _dequant_tile,
    _word_offsets,
    dequant_mode,
    dequantize_int4_ref,
)
from mllmd_kernels.w4a16_gemv import _w4a16_gemv_kernel


def w4a16_gemm_ref(
    x: torch.Tensor,  # [M, K]
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero_point: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: dequantize to x's dtype, then x @ W^T (+ bias) with float32 accumulation."""
    w = dequantize_int4_ref(w_packed, w_scale, w_zero_point, x.shape[-1], x.dtype)
    out = x.float() @ w.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def _w4a16_decode_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, KW] int32
    s_ptr,  # [N, G] float32 / bf16 / fp16 (any strides)
    z_ptr,  # [N, G] int8 (HAS_ZP)
    bias_ptr,  # [N] (HAS_BIAS: unsplit, or split with SERIAL)
    y_ptr,  # [M, N] (unsplit, or split with SERIAL)
    part_ptr,  # [SPLIT_K, M, N] float32 (IS_SPLIT)
    lock_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters (SERIAL)
    M,
    N,
    K,
    KW,  # words per weight row: ceil(K / 8)
    GROUP,  # columns per scale
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ym,
    K_PER_SPLIT,  # multiple of BLOCK_K
    SPLIT_K,
    BLOCK_M: tl.constexpr,  # >= 16 (tensor cores)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,  # IS_SPLIT: the last program of a tile reduces (else splitk_reduce)
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    MMA_VEC: tl.constexpr = 0,  # w_packed in w4a16_mma.tile_order (0: row-major)
    DEQUANT: tl.constexpr = 0,  # w4a16_dequant.dequant_mode
    GROUP_STEPS: tl.constexpr = 0,  # K steps per group (GROUP // BLOCK_K); 0: channel-wise
):
    """Skinny (2 <= M <= 64): W_tile @ x_tile^T on tensor cores, one K split per program along axis 1."""
    pdl_sync(USE_PDL)
    offs_n, mask_n, rows_n, k_start, k_len = n_tile_k_split(N, K, K_PER_SPLIT, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    w_ptrs = w_ptr + _word_offsets(rows_n, k_start // 8 + offs_w, stride_wn, MMA_VEC)
    s_rows = s_ptr + rows_n * stride_sn
    z_rows = z_ptr + rows_n * stride_zn
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_m = tl.where(mask_m, offs_m, 0).to(tl.int64)  # padding rows re-read row 0 (never stored)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        if GROUP_STEPS == 0:  # channel-wise
            g = 0
        else:
            g = ((k_start + k0) // BLOCK_K) // GROUP_STEPS  # constexpr divisors: no division in the loop
        word_mask = (k_start + k0) // 8 + offs_w < KW
        w = _dequant_tile(w_ptrs, word_mask, s_rows + g * stride_sg, z_rows + g * stride_zg, BLOCK_K, HAS_ZP,
                          EVEN_K, x_ptr.dtype.element_ty, DEQUANT)  # the reference's dequantized weight  # fmt: skip
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(k0 + offs_k < k_len)[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        if MMA_VEC == 0:
            w_ptrs += BLOCK_K // 8
        else:  # tile order is not affine along K inside a stage
            w_ptrs = w_ptr + _word_offsets(rows_n, (k_start + k0 + BLOCK_K) // 8 + offs_w, stride_wn, MMA_VEC)
        x_ptrs += BLOCK_K
    out_mask = mask_n[:, None] & mask_m[None, :]
    if IS_SPLIT:
        y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        bias_ptrs = bias_ptr + offs_n[:, None] + 0 * offs_m[None, :]
        splitk_store(acc, part_ptr + offs_m[None, :] * N + offs_n[:, None], M * N, out_mask, y_ptrs, bias_ptrs,
                     lock_ptr + tl.program_id(0), SPLIT_K, HAS_BIAS, SERIAL)  # fmt: skip
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, KW] int32
    s_ptr,  # [N, G] float32 / bf16 / fp16
    z_ptr,  # [N, G] int8 (HAS_ZP)
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    KW,
    GROUP,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    MMA_VEC: tl.constexpr = 0,  # w_packed in w4a16_mma.tile_order (0: row-major)
    DEQUANT: tl.constexpr = 0,  # w4a16_dequant.dequant_mode
    GROUP_STEPS: tl.constexpr = 0,  # K steps per group (GROUP // BLOCK_K); 0: channel-wise
):
    """Prefill: acc[BLOCK_M, BLOCK_N] = x_tile @ dequant(W_tile)^T, tiles swizzled by GROUP_M."""
    offs_m, offs_n, rows_m, rows_n = swizzled_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + _word_offsets(rows_n, offs_w, stride_wn, MMA_VEC)
    s_rows = s_ptr + rows_n * stride_sn
    z_rows = z_ptr + rows_n * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if GROUP_STEPS == 0:  # channel-wise
            g = 0
        else:
            g = (k0 // BLOCK_K) // GROUP_STEPS
        word_mask = k0 // 8 + offs_w < KW
        w = _dequant_tile(w_ptrs, word_mask, s_rows + g * stride_sg, z_rows + g * stride_zg, BLOCK_K, HAS_ZP,
                          EVEN_K, x_ptr.dtype.element_ty, DEQUANT)  # the reference's dequantized weight  # fmt: skip
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(k0 + offs_k < K)[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if MMA_VEC == 0:
            w_ptrs += BLOCK_K // 8
        else:
            w_ptrs = w_ptr + _word_offsets(rows_n, (k0 + BLOCK_K) // 8 + offs_w, stride_wn, MMA_VEC)
        x_ptrs += BLOCK_K
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    w_packed: torch.Tensor,  # [N, ceil(K / 8)] int32
    w_scale: torch.Tensor,  # [N, G] SCALE_DTYPES (any strides; column-major is best)
    w_zero_point: torch.Tensor | None = None,  # [N, G] int8 in [-8, 7]
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] x.dtype
    config: W4A16Config | None = None,
    splitk_counters: torch.Tensor | None = None,  # int32 zeros, >= splitk_counter_len(N) (this layer's own)
    mma_vec: int = 0,  # w_packed in w4a16_mma.tile_order(w, mma_vec) (0: row-major as stored)
    exact_scales: bool = False,  # every scale is a value of x's dtype (w4a16_dequant.scales_exact_in)
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) -> [M, N] in x's dtype, float32 accumulation; int4 unpacked in-kernel.

    Words in mma tile order (`mma_vec`) take the skinny and gemm tilings only: one row runs the
    skinny tiling instead of the gemv (whose loads and probes are built on row-major words).

    With `splitk_counters` a split-K launch reduces its own partials (the last program of each tile
    adds them) instead of launching `splitk_reduce`. The counters return to 0 after every
    launch; two launches must not share them at the same time (one set per layer, one stream).

    With `exact_scales` the tensor-core tilings dequantize in x's dtype from the nibble planes
    (`w4a16_dequant.dequant_mode`): the same weights, fewer instructions."""
    assert x.dim() == 2 and x.stride(1) == 1 and w_packed.stride(1) == 1, (
        "w4a16_gemm needs K-contiguous x and w_packed"
    )
    m, k = x.shape
    n, kw = w_packed.shape
    assert w_packed.dtype == torch.int32 and kw == cdiv(k, 8), (
        f"w_packed {tuple(w_packed.shape)} for K={k}"
    )
    assert w_scale.dim() == 2 and w_scale.shape[0] == n and w_scale.dtype in SCALE_DTYPES, (
        f"w_scale must be one of {SCALE_DTYPES}, not {w_scale.dtype}"
    )
    groups = w_scale.shape[1]
    assert k % groups == 0, f"K={k} is not a multiple of {groups} groups"
    group = k // groups
    has_zp = w_zero_point is not None
    if has_zp:
        assert w_zero_point.shape == w_scale.shape and w_zero_point.dtype == torch.int8
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0:
        return out
    _check_mma_order(w_packed, mma_vec)
    cfg = config or pick_w4a16_config(m, n, k, group, sm_count_for(x), max_shared_memory(x))
    if mma_vec and cfg.mode == "gemv":  # the gemv reads row-major words only: the skinny tiling of two rows
        assert config is None, "the gemv tiling reads row-major words only, not mma tile order"
        cfg = pick_w4a16_config(2, n, k, group, sm_count_for(x), max_shared_memory(x))
    bk = group_block_k(cfg.block_k, group, k)
    sub = cfg.sub_steps if cfg.mode == "gemv" else 1
    even_k = k % (bk * sub) == 0
    zp = w_zero_point if has_zp else w_scale  # any pointer: never read without HAS_ZP
    zs = (zp.stride(0), zp.stride(1))
    has_bias = bias is not None
    bias_arg = bias if has_bias else w_scale
    common = (m, n, k, kw, group, x.stride(0), w_packed.stride(0), w_scale.stride(0), w_scale.stride(1), *zs)
    if cfg.mode == "gemm":
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
        _w4a16_gemm_kernel[grid](
            x, w_packed, w_scale, zp, bias_arg, out, *common, out.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, HAS_ZP=has_zp,
            HAS_BIAS=has_bias, DOT_F32=dot_in_fp32(x.dtype), EVEN_K=even_k, MMA_VEC=mma_vec,
            DEQUANT=dequant_mode(x, exact_scales), GROUP_STEPS=0 if groups == 1 else group // bk,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return out
    k_per_split, split = k_splits(k, cfg.split_k, bk * sub)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (cdiv(n, cfg.block_n), split)
    serial = split > 1 and splitk_counters is not None
    if serial:
        assert splitk_counters.dtype == torch.int32 and splitk_counters.numel() >= grid[0], (
            f"{splitk_counters.numel()} split-K counters for {grid[0]} tiles"
        )
    locks = splitk_counters if serial else part
    if cfg.mode == "gemv":
        assert m == 1, f"the gemv tiling is for one row, not {m}"
        _w4a16_gemv_kernel[grid](
            x, w_packed, w_scale, zp, bias_arg, out, part, locks, n, k, kw, split, w_packed.stride(0),
            w_scale.stride(0), w_scale.stride(1), *zs, k_per_split,
            BLOCK_N=cfg.block_n, BLOCK_K=bk, SUB_STEPS=sub, TILED_W=cfg.tiled_w, LOAD_ONLY=cfg.load_only,
            GROUP_STEPS=0 if groups == 1 else group // bk,
            HAS_ZP=has_zp,
            HAS_BIAS=has_bias and (split == 1 or serial), IS_SPLIT=split > 1, SERIAL=serial, EVEN_K=even_k,
            NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,  # the kernel counts on FMAs (Triton 3.10 stops fusing by default)
            **pdl_args(x),
        )  # fmt: skip
    else:
        assert cfg.block_m >= m, f"block_m {cfg.block_m} < {m} rows"
        _w4a16_decode_kernel[grid](
            x, w_packed, w_scale, zp, bias_arg, out, part, locks, *common, out.stride(0), k_per_split, split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, HAS_ZP=has_zp,
            HAS_BIAS=has_bias and (split == 1 or serial), IS_SPLIT=split > 1, SERIAL=serial,
            DOT_F32=dot_in_fp32(x.dtype), EVEN_K=even_k, MMA_VEC=mma_vec, DEQUANT=dequant_mode(x, exact_scales),
            GROUP_STEPS=0 if groups == 1 else group // bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x),
        )  # fmt: skip
    if split > 1 and not serial:
        splitk_reduce(part, out, bias)
    return out
