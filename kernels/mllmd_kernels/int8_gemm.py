"""int8_gemm: int8 x int8 -> int32 GEMM with per-token and per-channel scales in the epilogue (the
W8A8 linear layer); int8 tensor cores from 2 rows on, an integer gemv for one row.

    y[m, n] = float(sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]), in out_dtype

a: int8 [M, K] activations (from `int8_quant`), b: int8 [N, K] weights exactly as compressed-tensors
stores them. K-major on both sides is the layout int8 MMA wants (mma.sync on sm80/sm87 and wgmma
on sm90 take 8-bit operands K-major only), so the weights are used as stored: no re-layout.
The accumulation is exact in int32 (|sum| < 2**31 for K < 2**17 at full range); the scaling is in
float32 in the reference's order ((acc * a_scale) * b_scale + bias), then one rounding to out_dtype.

Tilings are picked by M, no autotuning (`pick_int8_config`):
* "gemv" (M == 1, decode at batch 1): no tensor cores; each program streams [BLOCK_N, BLOCK_K]
  weight tiles (16-byte loads, evict-first) and multiply-adds them with the int8 row, keeping
  per-thread int32 partial sums that are reduced over K once at the end: by default as int32 words
  of four bytes, one `dp4a` instruction per word (sm61 and newer, so Orin too; in the interpreter
  the same sum by shifts), else widened to int32 (one sign extension and one IMAD per weight).
  16 rows x 1024 or 2048 columns per program: about two or more programs per SM on the Qwen3-8B
  projections without splitting K;
* "skinny" (M <= 64, decode): acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T (the weight fills the
  64-row MMA side, x is padded to 16+ rows);
* "gemm" (prefill): acc[BLOCK_M, BLOCK_N] = x_tile @ W_tile^T with a GROUP_M swizzle over output
  tiles; 64x128x128 up to 128 rows, 128x128x64 with 4 warps above (the fastest of the sweep on an
  H200, 80 KB of shared memory for its 5 stages: fits Orin and A100 too).
"gemv" and "skinny" split K where there are too few tiles for the SMs, with int32 partial sums
[SPLIT_K, M, N] that `_int8_splitk_epilogue_kernel` adds in a fixed order before the epilogue (exact
and deterministic: no atomics, no memset).
Nothing Hopper-only is on the default path of other GPUs (no TMA, no warp specialisation); Triton
lowers tl.dot to wgmma on sm90 and to mma.sync on sm80/sm87 by itself, and the gemv is plain loads
and integer arithmetic (dp4a exists since sm61). On sm90, prefills of TMA_MIN_ROWS rows and more
fetch their tiles by TMA instead (int8_gemm_tma), chosen by capability (`tma_supported`).

`w8a8_gemv` (what `w8a8_linear` runs for one row) fuses the per-token quantization into the gemv:
every program takes max|x| over the whole row (at most a few tens of KB, L2-resident) and quantizes
its own x slices with `int8_quant`'s code, so q and the scale equal `int8_quant`'s bit for bit and
the output equals int8_quant + int8_gemm's bit for bit, in one launch instead of two.
`int8_gemm_silu_mul` (a W8A8 gate/up projection of one row) pairs each gate output with its up output
in the gemv's epilogue and stores silu(gate) * up: silu_and_mul(int8_gemm(...)) bit for bit, without
the second launch (H200, Qwen3-8B gate_up: 26.3 against 27.0 us alone; 2.741 against 2.751 ms a decode
step, in different runs).

No host synchronisation: the launches depend only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mllmd_kernels import knobs
from mllmd_kernels._triton import (
    cdiv,
    interpreting,
    next_pow2,
    pdl_args,
    pdl_sync,
    prefetch_tile_l2,
    sm_count_for,
    tl,
    triton,
)
from mllmd_kernels.activation import _silu_mul, silu_and_mul
from mllmd_kernels.int8_quant import _quant_row, int8_quant, int8_quant_ref, int8_scale, row_int8_scale
from mllmd_kernels.splitk import auto_split, k_splits, splitk_reduce
from mllmd_kernels.tiling import fit_stages, k_step_loads, max_shared_memory, n_tile_k_split, swizzled_tile

# From this many rows on, sm90 (where `tma_supported`) runs the prefill GEMM with TMA loads
# (int8_gemm_tma, "tma" 128x128x64): on the H200 the W8A8 Qwen3-8B 2,048-token prefill took 34.8 ms
# against 35.9 ms with the pointer tiling in the same run (bench_quant: 676 against 713 us a layer).
# Not below: each TMA launch costs about 20 us more host time (two tensor maps encoded: 54.5 against
# 34.6 us a launch), which a shorter prefill, bound by the host, would pay in full.
# MLLMD_INT8_TMA_MIN_ROWS overrides it (a diagnostic: a large value turns the TMA tiling off).
TMA_MIN_ROWS = knobs.int8_tma_min_rows()
GEMV_SCALE_BYTES = 16384  # w8a8_gemv: bytes of x per step of each program's max|x| pass
TMA_MODES = ("tma", "tma_persistent")


def int8_gemm_ref(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M, 1] float32
    b_scale: torch.Tensor,  # [N, 1] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Torch reference: the integer products summed exactly (float64 holds every int8 dot product
    of K < 2**38 exactly), then (acc * a_scale) * b_scale (+ bias) in float32, rounded to out_dtype."""
    acc = (a.double() @ b.double().t()).float()  # == float32(int32 accumulator): one rounding either way
    out = acc * a_scale.float().view(-1, 1) * b_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of the W8A8 linear: per-token int8 x [M, K], int8 weight [N, K] -> [M, N] x.dtype."""
    q, s = int8_quant_ref(x)
    return int8_gemm_ref(q, weight, s, weight_scale, x.dtype, bias)


@dataclass(frozen=True)
class Int8GemmConfig:
    mode: str  # "gemv" (M == 1, no tensor cores) | "skinny" (W as the MMA's 64-row side; M <= 64) | "gemm"
    # | "tma" / "tma_persistent" (the "gemm" product with TMA loads: sm90+ only, int8_gemm_tma; "tma" is
    # picked from TMA_MIN_ROWS rows where tma_supported)
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    split_k: int
    num_warps: int
    num_stages: int  # "gemv": 1 (its loads feed no tl.dot; more warps hide the latency instead)
    dp4a: bool = False  # "gemv": four byte products a word in one instruction (dp4a, sm61+; needs K % 4 == 0)


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked on every launch
def pick_int8_config(m: int, n: int, k: int, num_sms: int, smem: int, tma: bool = False) -> Int8GemmConfig:
    """Tile sizes for a[m, k] @ b[n, k]^T by M (decode / mid / prefill), fitted to shared memory;
    `tma`: the operands can be fetched by TMA (`tma_supported`), taken from TMA_MIN_ROWS rows on."""
    if m == 1:
        # 16 weight rows per program (w8a8_gemv quantizes each x slice once per program), 128 bytes of
        # weights per thread and K step; 8 warps on 2048 columns where there are fewer than two tiles
        # per SM (o, down on an H200), K split only where that still leaves too few programs.
        bn = 16
        tiles = cdiv(n, bn)
        bk, warps = (1024, 4) if tiles >= 2 * num_sms else (2048, 8)
        bk = min(bk, max(16, next_pow2(k)))
        warps = max(1, min(warps, bn * bk // 512))  # >= 16 columns (one 16-byte load) per thread
        split = auto_split(tiles, k, bk, num_sms, ctas_per_sm=2, min_blocks=2)
        # dp4a: 5-10% faster on all four projections in the H200 sweep (bench_quant --m 1 --sweep int8)
        return Int8GemmConfig("gemv", 1, bn, bk, 1, split, warps, 1, dp4a=True)
    if m <= 64:
        bm = max(16, next_pow2(m))
        bn, bk = 64, (256 if bm <= 32 else 128)
        stages = fit_stages((bm + bn) * bk, 4, smem)
        split = auto_split(cdiv(n, bn), k, bk, num_sms)
        return Int8GemmConfig("skinny", bm, bn, bk, 1, split, 4, stages)
    if tma and m >= TMA_MIN_ROWS:
        return Int8GemmConfig("tma", 128, 128, 64, 8, 1, 4, fit_stages((128 + 128) * 64, 5, smem))
    if m <= 128:
        bm, bn, bk, warps, stages = 64, 128, 128, 4, 4
    else:
        # H200 sweep at M=2048 on the Qwen3-8B shapes (bench_quant --m 2048 --sweep): 128x128x64 with
        # 4 warps and 5 stages was the fastest of 20 tilings on all four, 5-10% ahead of 128x256x128
        # with 8 warps (qkv 89 us, o 61, gate_up 357, down 168); 80 KB of shared memory fits sm87 too.
        bm, bn, bk, warps, stages = 128, 128, 64, 4, 5
    return Int8GemmConfig("gemm", bm, bn, bk, 8, 1, warps, fit_stages((bm + bn) * bk, stages, smem))


@triton.jit
def _store_scaled_tile(acc, offs_m, offs_n, M, N, as_ptr, bs_ptr, bias_ptr, c_ptr, stride_cm, HAS_BIAS: tl.constexpr):
    """The epilogue of an [len(offs_m), len(offs_n)] output tile, stored in c's dtype (edges masked)."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    out = _int8_epilogue(acc, offs_m, offs_n, mask_m, mask_n, as_ptr, bs_ptr, bias_ptr, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int8_epilogue(acc, offs_m, offs_n, mask_m, mask_n, as_ptr, bs_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """float32 (acc * a_scale[m]) * b_scale[n] (+ bias[n]) for acc [len(offs_m), len(offs_n)]."""
    a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    b_s = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc.to(tl.float32) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _int8_gemm_kernel(
    a_ptr,  # [M, K] int8
    b_ptr,  # [N, K] int8
    as_ptr,  # [M] float32
    bs_ptr,  # [N] float32
    bias_ptr,  # [N] (HAS_BIAS)
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Prefill: acc[BLOCK_M, BLOCK_N] = a_tile @ b_tile^T over K in int32, output tiles swizzled in
    groups of GROUP_M rows of tiles (so the b tiles of neighbouring programs are shared in L2)."""
    offs_m, offs_n, rows_a, rows_b = swizzled_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0)
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_scaled_tile(acc, offs_m, offs_n, M, N, as_ptr, bs_ptr, bias_ptr, c_ptr, stride_cm, HAS_BIAS)


@triton.jit
def _int8_skinny_kernel(
    a_ptr,  # [M, K] int8
    b_ptr,  # [N, K] int8
    as_ptr,  # [M] float32
    bs_ptr,  # [N] float32
    bias_ptr,  # [N] (HAS_BIAS)
    c_ptr,  # [M, N] (not IS_SPLIT)
    part_ptr,  # [SPLIT_K, M, N] int32 (IS_SPLIT)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    K_PER_SPLIT,  # multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Decode: acc[BLOCK_N, BLOCK_M] = b_tile @ a_tile^T in int32 over one K split."""
    pdl_sync(USE_PDL)
    pid_k = tl.program_id(1)
    offs_n, mask_n, rows_b, k_start, k_len = n_tile_k_split(N, K, K_PER_SPLIT, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_a = tl.where(mask_m, offs_m, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (k_start + offs_k)[None, :]
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for k0 in range(0, k_len, BLOCK_K):
        k_mask = ((k0 + offs_k) < k_len)[None, :]
        a, b = k_step_loads(a_ptrs, b_ptrs, k_mask, k_mask, EVEN_K)
        acc = tl.dot(b, tl.trans(a), acc, out_dtype=tl.int32)
        b_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_mask = mask_n[:, None] & mask_m[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)
    else:
        a_s = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
        out = acc.to(tl.float32) * a_s[None, :] * b_s[:, None]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + offs_m[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dot4(w, a, acc, USE_ASM: tl.constexpr):
    """acc + the dot product of the four signed bytes of the int32 words w and a: PTX dp4a.s32.s32
    (sm61 and newer), or the same sum by shifts where inline assembly cannot run (the interpreter)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, acc], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        for r in tl.static_range(4):
            acc += ((w << (24 - 8 * r)) >> 24) * ((a << (24 - 8 * r)) >> 24)
        return acc


@triton.jit
def _pack_words(q, BLOCK_K: tl.constexpr):
    """int8 values q [BLOCK_K] (any integer type) -> [BLOCK_K // 4] int32 words, byte i of word j =
    q[4 j + i] (little-endian, as an int8 row viewed as int32 in memory)."""
    b = tl.reshape(q.to(tl.int32) & 0xFF, (BLOCK_K // 4, 4))
    return tl.sum(b << (tl.arange(0, 4) * 8)[None, :], axis=1)  # disjoint bytes: the sum is the bitwise or


@triton.jit
def _dp4a_weights(b_ptrs, k0, k_len, offs_w, EVEN_K: tl.constexpr):
    """The weight words [BLOCK_N, BLOCK_K // 4] of the K step at k0 (streamed, evict-first; 0 past k_len)."""
    if EVEN_K:
        return tl.load(b_ptrs, eviction_policy="evict_first")
    else:
        return tl.load(b_ptrs, mask=((k0 + 4 * offs_w) < k_len)[None, :], other=0, eviction_policy="evict_first")


@triton.jit
def _dp4a_step(
    acc, b, a_ptr, a_scale, k0, k_start, k_len, offs_w, offs_k,
    BLOCK_K: tl.constexpr, FUSE_QUANT: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """acc + the K step at k0: the weight words b times the row's int8 words there (FUSE_QUANT: the
    float row's slice, quantized here; masked columns: x = 0 -> q = 0)."""
    if FUSE_QUANT:
        x = tl.load(a_ptr + k_start + k0 + offs_k, mask=(k0 + offs_k) < k_len, other=0.0).to(tl.float32)
        a = _pack_words(_quant_row(x, a_scale), BLOCK_K)
    else:
        a = tl.load(a_ptr + (k_start + k0) // 4 + offs_w, mask=(k0 + 4 * offs_w) < k_len, other=0)
    return _dot4(b, a[None, :], acc, USE_ASM)


@triton.jit
def _int8_gemv_kernel(
    a_ptr,  # [K] int8 activations, or the float row x [K] (FUSE_QUANT)
    b_ptr,  # [N, K] int8
    as_ptr,  # [1] float32: read, or (FUSE_QUANT and IS_SPLIT) written by program (0, 0)
    bs_ptr,  # [N] float32
    bias_ptr,  # [N] (HAS_BIAS, not IS_SPLIT)
    c_ptr,  # [N] (not IS_SPLIT)
    part_ptr,  # [SPLIT_K, N] int32 (IS_SPLIT)
    N,
    K,
    stride_bn,
    K_PER_SPLIT,  # multiple of BLOCK_K
    amax_ptr,  # [n_amax] float32: max|x| partials read (AMAX_IN) or written (AMAX_OUT)
    n_amax,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,  # FUSE_QUANT: x elements per step of the max|x| pass
    DP4A: tl.constexpr,  # b (and a, unless FUSE_QUANT) are the int8 tensors viewed as int32 words [.., K // 4]
    USE_ASM: tl.constexpr,  # DP4A: the dp4a instruction (False only in the interpreter)
    USE_PDL: tl.constexpr,
    SILU_MUL: tl.constexpr = False,  # b is a fused gate/up weight [2 D, K]: c [D] = silu(gate) * up (no split)
    PREFETCH: tl.constexpr = False,  # USE_PDL: the first K step's weights into L2 before the wait
    AMAX_IN: tl.constexpr = 0,  # FUSE_QUANT: max|x| = the max of n_amax <= AMAX_IN partials (no pass over x)
    AMAX_OUT: tl.constexpr = False,  # SILU_MUL: program p writes the max |output| of its outputs to amax[p]
):
    """M == 1, no tensor cores: [BLOCK_N, BLOCK_K] int8 weight tiles times the int8 row. DP4A: both as
    int32 words, one dp4a per word into acc[BLOCK_N, BLOCK_K // 4]; else both widened to int32 and
    multiply-added into per-thread partial sums acc[BLOCK_N, BLOCK_K // 16] (a group of 16 columns is
    one thread's 16-byte load, so the reshape moves no data); either way reduced over K at the end;
    exact in int32. FUSE_QUANT: a is the float row; every program takes the row's scale from all of x
    and quantizes its x slices itself (`_quant_row`: int8_quant's q bit for bit). SILU_MUL: the
    program's rows alternate gate row j and up row D + j for BLOCK_N / 2 outputs j, which the
    epilogue rounds to c's dtype (the gemm's output) and pairs into silu(gate) * up
    (`silu_and_mul`'s rounding), so the [2 D] projection row is never written."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, mask_n, rows_b, k_start, k_len = n_tile_k_split(N, K, K_PER_SPLIT, BLOCK_N)
    if SILU_MUL:  # row 2 i + h of the tile: gate (h = 0) or up (h = 1) row of output pid_n * BLOCK_N / 2 + i
        i = tl.arange(0, BLOCK_N)
        pair = pid_n * (BLOCK_N // 2) + i // 2
        mask_n = pair < N // 2
        offs_n = pair + (i % 2) * (N // 2)
        rows_b = tl.where(mask_n, offs_n, 0).to(tl.int64)
    if USE_PDL and PREFETCH:  # the first K step's [BLOCK_N, BLOCK_K] bytes of weights (see _triton.py)
        prefetch_tile_l2(b_ptr.to(tl.pointer_type(tl.int8)), rows_b, mask_n, stride_bn, k_start, k_len, BLOCK_K, 128)
    pdl_sync(USE_PDL)
    offs_k = tl.arange(0, BLOCK_K)
    if FUSE_QUANT and AMAX_IN > 0:  # the op that wrote x left max|x| of its slices: one short load
        offs_p = tl.arange(0, AMAX_IN)
        a_scale = int8_scale(tl.max(tl.load(amax_ptr + offs_p, mask=offs_p < n_amax, other=0.0), axis=0))
    elif FUSE_QUANT:
        a_scale = row_int8_scale(a_ptr, K, SCALE_BLOCK)
    else:
        a_scale = tl.load(as_ptr)
    if DP4A:  # word offsets: k_start and every K step are multiples of BLOCK_K, K of 4
        offs_w = tl.arange(0, BLOCK_K // 4)
        b_ptrs = b_ptr + rows_b[:, None] * (stride_bn // 4) + (k_start // 4 + offs_w)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.int32)
        for k0 in range(0, k_len, BLOCK_K):
            b = _dp4a_weights(b_ptrs, k0, k_len, offs_w, EVEN_K)
            acc = _dp4a_step(acc, b, a_ptr, a_scale, k0, k_start, k_len, offs_w, offs_k, BLOCK_K, FUSE_QUANT, USE_ASM)
            b_ptrs += BLOCK_K // 4
    else:
        b_ptrs = b_ptr + rows_b[:, None] * stride_bn + (k_start + offs_k)[None, :]
        a_ptrs = a_ptr + k_start + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.int32)
        for k0 in range(0, k_len, BLOCK_K):
            k_mask = (k0 + offs_k) < k_len
            a, b = k_step_loads(a_ptrs, b_ptrs, k_mask, k_mask[None, :], EVEN_K)
            if FUSE_QUANT:  # masked columns: x = 0 -> q = 0
                a = _quant_row(a.to(tl.float32), a_scale)
            prod = b.to(tl.int32) * a.to(tl.int32)[None, :]
            acc += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
            b_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
    acc_n = tl.sum(acc, axis=1)  # [BLOCK_N], exact
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * N + offs_n, acc_n, mask=mask_n)
        if FUSE_QUANT:
            if (pid_n == 0) & (pid_k == 0):
                tl.store(as_ptr, a_scale)  # for splitk_reduce (a later launch)
    else:
        out = acc_n.to(tl.float32) * a_scale * tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SILU_MUL:
            gate, up = tl.split(tl.reshape(out.to(c_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N // 2, 2)))
            offs_d = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            y = _silu_mul(gate, up, c_ptr.dtype.element_ty)  # the stored values, in fp32
            tl.store(c_ptr + offs_d, y.to(c_ptr.dtype.element_ty), mask=offs_d < N // 2)
            if AMAX_OUT:
                tl.store(amax_ptr + pid_n, tl.max(tl.where(offs_d < N // 2, tl.abs(y), 0.0), axis=0))
        else:
            tl.store(c_ptr + offs_n, out.to(c_ptr.dtype.element_ty), mask=mask_n)


def int8_gemm(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M, 1] or [M] float32
    b_scale: torch.Tensor,  # [N, 1] or [N] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] out_dtype
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:
    """(a @ b^T) * a_scale * b_scale^T (+ bias) -> [M, N] out_dtype, exact int32 accumulation (on
    tensor cores, or the integer gemv for one row)."""
    assert a.dtype == torch.int8 and b.dtype == torch.int8 and a.dim() == 2 and b.dim() == 2
    assert a.shape[1] == b.shape[1] and a.stride(1) == 1 and b.stride(1) == 1, (
        "int8_gemm needs K-contiguous a and b"
    )
    m, k = a.shape
    n = b.shape[0]
    assert a_scale.numel() == m and b_scale.numel() == n
    assert a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32
    a_scale = a_scale.reshape(m).contiguous()
    b_scale = b_scale.reshape(n).contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0:
        return out
    has_bias = bias is not None
    bias_arg = bias if has_bias else b_scale  # any pointer: never read without HAS_BIAS
    if config is None:
        tma = False
        if m >= TMA_MIN_ROWS and a.is_cuda:
            from mllmd_kernels.int8_gemm_tma import tma_supported  # imports this module

            tma = tma_supported(a, b)
        config = pick_int8_config(m, n, k, sm_count_for(a), max_shared_memory(a), tma)
    cfg = config
    if cfg.mode in TMA_MODES:  # sm90: the operand tiles come by TMA (int8_gemm_tma)
        from mllmd_kernels.int8_gemm_tma import int8_gemm_tma, tma_supported  # imports this module

        assert tma_supported(a, b) or not a.is_cuda, f"{cfg.mode} needs sm90+ and Triton tensor descriptors"
        return int8_gemm_tma(a, b, a_scale, b_scale, bias, out, cfg, sm_count_for(a))
    if cfg.mode == "gemm":
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
        _int8_gemm_kernel[grid](
            a, b, a_scale, b_scale, bias_arg, out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            HAS_BIAS=has_bias, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return out
    if cfg.mode == "gemv":
        assert m == 1, f"gemv tiling for {m} rows"
        return _gemv(a, b, a_scale, b_scale, bias, out, cfg, fuse_quant=False)
    assert cfg.block_m >= m, f"block_m {cfg.block_m} < {m} rows"
    k_per_split, split = k_splits(k, cfg.split_k, cfg.block_k)
    part = torch.empty((split, m, n), dtype=torch.int32, device=a.device) if split > 1 else out
    _int8_skinny_kernel[(cdiv(n, cfg.block_n), split)](
        a, b, a_scale, b_scale, bias_arg, out, part, m, n, k, a.stride(0), b.stride(0), out.stride(0), k_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=has_bias, IS_SPLIT=split > 1,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a),
    )  # fmt: skip
    if split > 1:
        splitk_reduce(part, out, bias, a_scale, b_scale)
    return out


def _gemv(
    a: torch.Tensor,  # [1, K] int8, or the float row x [1, K] (fuse_quant)
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor | None,  # [1] float32 (None with fuse_quant)
    b_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [1, N]
    cfg: Int8GemmConfig,
    fuse_quant: bool,
    silu_mul: bool = False,  # b is a gate/up weight [2 D, K]; out [1, D] = silu(gate) * up (one K split only)
    amax_in: torch.Tensor | None = None,  # fuse_quant: float32 partials whose max is max|a|
    amax_out: torch.Tensor | None = None,  # silu_mul: float32 [programs], each program's max |out|
) -> torch.Tensor:
    """Launch `_int8_gemv_kernel` (+ the split-K epilogue) for one row."""
    assert cfg.block_k >= 16 and cfg.split_k >= 1, cfg
    k = a.shape[1]
    n = b.shape[0]
    k_per_split, split = k_splits(k, cfg.split_k, cfg.block_k)
    assert not silu_mul or (split == 1 and n % 2 == 0 and cfg.block_n % 2 == 0), "silu_mul: one K split, even N"
    part = torch.empty((split, 1, n), dtype=torch.int32, device=a.device) if split > 1 else out
    if a_scale is None:  # fused: the kernel's scale, kept for the split-K epilogue
        a_scale = torch.empty(1, dtype=torch.float32, device=a.device) if split > 1 else b_scale
    has_bias = bias is not None
    bias_arg = bias if has_bias else b_scale  # any pointer: never read without HAS_BIAS
    scale_block = min(next_pow2(k), GEMV_SCALE_BYTES // a.element_size())
    words = [b] if fuse_quant else [a, b]  # the int8 tensors read as int32 words with dp4a
    dp4a = cfg.dp4a and k % 4 == 0 and cfg.block_k >= 64
    dp4a = dp4a and all(t.stride(0) % 4 == 0 and t.storage_offset() % 4 == 0 for t in words)
    if dp4a:  # the same bytes as int32 words (a stays the float row when the quantization is fused)
        b = b.view(torch.int32)
        a = a if fuse_quant else a.view(torch.int32)
    assert amax_in is None or fuse_quant, "amax_in: the quantization is fused"
    assert amax_out is None or (silu_mul and amax_out.numel() >= cdiv(n, cfg.block_n)), "amax_out: one per program"
    amax = amax_in if amax_in is not None else amax_out if amax_out is not None else b_scale
    n_amax = amax.numel() if amax_in is not None else 0
    _int8_gemv_kernel[(cdiv(n, cfg.block_n), split)](
        a, b, a_scale, b_scale, bias_arg, out, part, n, k, b.stride(0) * (4 if dp4a else 1), k_per_split,
        amax, n_amax,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=has_bias and split == 1, IS_SPLIT=split > 1,
        EVEN_K=k % cfg.block_k == 0, FUSE_QUANT=fuse_quant, SCALE_BLOCK=scale_block,
        DP4A=dp4a, USE_ASM=not interpreting(), SILU_MUL=silu_mul, PREFETCH=cfg.block_k >= 128,
        AMAX_IN=next_pow2(n_amax) if n_amax else 0, AMAX_OUT=amax_out is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(a),
    )  # fmt: skip
    if split > 1:
        splitk_reduce(part, out, bias, a_scale, b_scale)
    return out


def int8_gemm_silu_mul(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [2 D, K] int8: gate rows, then up rows
    a_scale: torch.Tensor,  # [M, 1] or [M] float32
    b_scale: torch.Tensor,  # [2 D, 1] or [2 D] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [2 D]
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:
    """silu_and_mul(int8_gemm(...)) -> [M, D] out_dtype, bit for bit. One row with an unsplit gemv
    tiling (the default for a fused gate/up projection) takes one launch: the gemv's epilogue pairs
    each gate output with its up output, so the [M, 2 D] projection is never written; otherwise the
    two launches."""
    return int8_gemm_silu_mul_amax(a, b, a_scale, b_scale, out_dtype, bias, config, amax=False)[0]


def int8_gemm_silu_mul_amax(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: Int8GemmConfig | None = None,
    amax: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int8_gemm_silu_mul, and where it takes one launch (and `amax`), the max |output| of each of
    its programs' outputs (float32 partials: their max is max|out|, exactly), which a W8A8 gemv that
    quantizes this row takes its scale from (`w8a8_gemv(amax_parts=...)`) instead of reading the
    row twice; None where the two launches ran."""
    m, k = a.shape
    n = b.shape[0]
    assert n % 2 == 0, f"a gate/up weight has an even number of rows, not {n}"
    if m == 1 and a.dtype == torch.int8 and b.dtype == torch.int8 and a.stride(1) == 1 and b.stride(1) == 1:
        cfg = config or pick_int8_config(1, n, k, sm_count_for(a), max_shared_memory(a))
        if cfg.mode == "gemv" and k_splits(k, cfg.split_k, cfg.block_k)[1] == 1:
            assert b.shape[1] == k and a_scale.numel() == 1 and b_scale.numel() == n
            assert a_scale.dtype == torch.float32 and b_scale.dtype == torch.float32
            out = torch.empty((1, n // 2), dtype=out_dtype, device=a.device)
            b_scale = b_scale.reshape(n).contiguous()
            a_scale = a_scale.reshape(1).contiguous()
            parts = torch.empty(cdiv(n, cfg.block_n), dtype=torch.float32, device=a.device) if amax else None
            _gemv(a, b, a_scale, b_scale, bias, out, cfg, fuse_quant=False, silu_mul=True, amax_out=parts)
            return out, parts
    return silu_and_mul(int8_gemm(a, b, a_scale, b_scale, out_dtype, bias, config=config)), None


def w8a8_gemv(
    x: torch.Tensor,  # [1, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [1, N] x.dtype
    config: Int8GemmConfig | None = None,  # a "gemv" tiling
    amax_parts: torch.Tensor | None = None,  # float32 [P]: max over them = max|x| (int8_gemm_silu_mul_amax)
) -> torch.Tensor:
    """W8A8 linear of one row in one launch (two with split-K): the per-token quantization is fused
    into the gemv (every program quantizes its x slices itself, its scale from max|x|: a pass over x,
    or the max of `amax_parts`); equals int8_quant + int8_gemm bit for bit."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1, "w8a8_gemv needs one K-contiguous row"
    assert weight.dtype == torch.int8 and weight.dim() == 2 and weight.stride(1) == 1
    n, k = weight.shape
    assert x.shape[1] == k and weight_scale.numel() == n and weight_scale.dtype == torch.float32
    weight_scale = weight_scale.reshape(n).contiguous()
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    assert out.shape == (1, n) and out.stride(1) == 1
    cfg = config or pick_int8_config(1, n, k, sm_count_for(x), max_shared_memory(x))
    assert cfg.mode == "gemv", f"w8a8_gemv needs a gemv tiling, got {cfg.mode}"
    assert amax_parts is None or (amax_parts.dtype == torch.float32 and amax_parts.dim() == 1), "float32 [P] partials"
    return _gemv(x, weight, None, weight_scale, bias, out, cfg, fuse_quant=True, amax_in=amax_parts)


def w8a8_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N, 1] float32
    bias: torch.Tensor | None = None,
    config: Int8GemmConfig | None = None,
    amax_parts: torch.Tensor | None = None,  # one row: as w8a8_gemv's (ignored by the other paths)
) -> torch.Tensor:
    """W8A8 linear with Triton: per-token int8 quantization of x, then int8_gemm -> [M, N] x.dtype.

    One row with a gemv tiling (the default): `w8a8_gemv`, the quantization fused in. Since the
    quantization divides by one fma-corrected reciprocal (`_quant_row`) and the gemv uses dp4a, the
    fused launch is also the faster one where there are few weight tiles per SM: o on the H200 took
    6.9 us fused against 6.1 us for the gemv alone plus a quantization launch."""
    if x.shape[0] == 1 and (config is None or config.mode == "gemv"):
        return w8a8_gemv(x, weight, weight_scale, bias, config=config, amax_parts=amax_parts)
    q, s = int8_quant(x)
    return int8_gemm(q, weight, s, weight_scale, x.dtype, bias, config=config)
