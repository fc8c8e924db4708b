"""w4a16_gemv: the W4A16 GEMM of one row (decode at batch 1), float32 FMAs on the int4 weights.

M == 1 is bound by instructions, not bytes (an H200 streams ~8e12 int4 weights/s and issues ~33e12
instructions/s), so it never widens: the word tile is 8 nibble planes (plane i holds k = 8j + i of
word column j) and a weight costs three instructions. One LOP3 puts the nibble into 2**23's mantissa
where it lies: (word & 0xF << s) | 0x4B000000 = 2**23 + n * 2**s as a float (s = 4i for planes
0..4, s = 4i - 16 in word >> 16 for planes 5..7: one shift per word); one FMA scales by 2**-s and
subtracts 2**(23 - s) + 8 + zero_point, giving q - zero_point exactly; one FMA multiplies by
x[8j + i] into a float32 partial. Once per K step the partial is multiplied by the row's scale
(channel-wise: once, at the end). Per K step x's planes come from one [BLOCK_K / 8, 8] load split
with tl.split, and the words are prefetched NUM_STAGES steps ahead through shared memory (cp.async).
The weight stays in float32 (slightly more accurate than the reference's rounding to x's dtype).
No tensor cores: a one-row tensor-core version issues fewer instructions a weight but pays more in
the shared-memory round trips and barriers of its MMA operands (slower on every Qwen3-8B shape;
this and the other variants tried: NOTES.md).

`w4a16_gemm` launches it (the format, the tiling, split-K: `w4a16_dequant`, `w4a16_config`,
`splitk`); `tile_words` is the weight layout of bench_quant's DRAM-locality probe (`tiled_w`).
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import pdl_sync, tl, triton
from mllmd_kernels.splitk import splitk_store
from mllmd_kernels.tiling import n_tile_k_split


@triton.jit
def _nibble(words, SHIFT: tl.constexpr, magic, bias):
    """(q - zero_point) in float32, exactly, for the nibble at bits [SHIFT, SHIFT + 4) of each word:
    ORed into the mantissa of magic = 2**23 it reads 2**23 + n * 2**SHIFT (SHIFT + 4 <= 23); one FMA
    scales that by 2**-SHIFT and subtracts bias = 2**(23 - SHIFT) + 8 + zero point."""
    f = ((words & (0xF << SHIFT)) | magic).to(tl.float32, bitcast=True)
    return f * (1.0 / (1 << SHIFT)) - bias


@triton.jit
def _biases(z_ptrs, HAS_ZP: tl.constexpr):
    """2**(23 - SHIFT) + 8 + zero point for SHIFT = 0, 4, 8, 12, 16 ([BLOCK_N, 1] float32, or scalars)."""
    if HAS_ZP:
        zq = tl.load(z_ptrs).to(tl.float32) + 8.0
        b0, b4, b8 = (8388608.0 + zq)[:, None], (524288.0 + zq)[:, None], (32768.0 + zq)[:, None]
        b12, b16 = (2048.0 + zq)[:, None], (128.0 + zq)[:, None]
    else:
        b0, b4, b8, b12, b16 = 8388616.0, 524296.0, 32776.0, 2056.0, 136.0
    return b0, b4, b8, b12, b16


@triton.jit
def _x_planes(x_ptrs, k_left, BW: tl.constexpr, EVEN_K: tl.constexpr):
    """x[8j + i] for i = 0..7 as 8 float32 [BW] tensors from one [BW, 8] load (0 from k_left on)."""
    offs = tl.arange(0, BW)[:, None] * 8 + tl.arange(0, 8)[None, :]
    if EVEN_K:
        x = tl.load(x_ptrs + offs)
    else:
        x = tl.load(x_ptrs + offs, mask=offs < k_left, other=0.0)
    ev, od = tl.split(tl.reshape(x.to(tl.float32), (BW, 4, 2)))  # x[8j + 2p], x[8j + 2p + 1]
    e0, e1 = tl.split(tl.reshape(ev, (BW, 2, 2)))  # x[8j + 4q], x[8j + 4q + 2]
    o0, o1 = tl.split(tl.reshape(od, (BW, 2, 2)))  # x[8j + 4q + 1], x[8j + 4q + 3]
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gemv_k_step(
    acc,  # [BLOCK_N, BW] float32 (channel-wise: unscaled sums; else scaled)
    w_ptrs,  # [BLOCK_N, BW] this step's words
    x_ptrs,  # x at this step's first column
    s_rows,  # [BLOCK_N] the rows' scales (group 0)
    z_rows,  # [BLOCK_N] the rows' zero points (group 0; HAS_ZP)
    magic,  # 0x4B000000 in a register
    k_abs,  # this step's first column
    k_left,  # columns of this program's split from here on (<= 0: a sub-step past K, all masked)
    w_col,  # this step's first word column
    K,
    KW,
    stride_sg,
    stride_zg,
    BLOCK_K: tl.constexpr,
    GROUP_STEPS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOAD_ONLY: tl.constexpr = False,
):
    """One K step of the one-row gemv: acc + the step's eight nibble planes times x's planes (times
    the rows' scales of the step's group, unless channel-wise). LOAD_ONLY (a probe): the same loads,
    one FMA a word."""
    BW: tl.constexpr = BLOCK_K // 8
    if GROUP_STEPS == 0:  # the row's zero point, an L1 hit after the first step (Triton 3.0, Orin's,
        # cannot carry a tuple of biases from before the loop into it)
        b0, b4, b8, b12, b16 = _biases(z_rows, HAS_ZP)
    else:
        g = tl.minimum(k_abs, K - 1) // (BLOCK_K * GROUP_STEPS)  # a sub-step past K reads the last group
        s = tl.load(s_rows + g * stride_sg).to(tl.float32)
        b0, b4, b8, b12, b16 = _biases(z_rows + g * stride_zg, HAS_ZP)
    if EVEN_K:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        word_mask = w_col + tl.arange(0, BW) < KW
        words = tl.load(w_ptrs, mask=word_mask[None, :], other=0, eviction_policy="evict_first")
    hi = words >> 16  # planes 5..7 at bits 4, 8, 12: one shift per word
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_ptrs, k_left, BW, EVEN_K)
    if LOAD_ONLY:
        part = words.to(tl.float32, bitcast=True) * (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)[None, :]
        if GROUP_STEPS == 0:
            part += acc
    else:
        part = _nibble(words, 0, magic, b0) * x0[None, :]
        if GROUP_STEPS == 0:
            part += acc
        part += _nibble(words, 4, magic, b4) * x1[None, :]
        part += _nibble(words, 8, magic, b8) * x2[None, :]
        part += _nibble(words, 12, magic, b12) * x3[None, :]
        part += _nibble(words, 16, magic, b16) * x4[None, :]
        part += _nibble(hi, 4, magic, b4) * x5[None, :]
        part += _nibble(hi, 8, magic, b8) * x6[None, :]
        part += _nibble(hi, 12, magic, b12) * x7[None, :]
    if GROUP_STEPS == 0:
        acc = part
    else:
        acc += part * s[:, None]
    return acc


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [N, KW] int32
    s_ptr,  # [N, G] float32 / bf16 / fp16 (any strides)
    z_ptr,  # [N, G] int8 (HAS_ZP)
    bias_ptr,  # [N] (HAS_BIAS: unsplit, or split with SERIAL)
    y_ptr,  # [1, N] (unsplit, or split with SERIAL)
    part_ptr,  # [SPLIT_K, 1, N] float32 (IS_SPLIT)
    lock_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters (SERIAL)
    N,
    K,
    KW,  # words per weight row: ceil(K / 8)
    SPLIT_K,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    K_PER_SPLIT,  # multiple of BLOCK_K * SUB_STEPS
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides the group: one scale per row and K step
    SUB_STEPS: tl.constexpr,  # K steps per loop trip (each its own scale)
    TILED_W: tl.constexpr,  # probe: words in `tile_words` order
    LOAD_ONLY: tl.constexpr,  # probe: no nibble math
    GROUP_STEPS: tl.constexpr,  # K steps per group; 0: channel-wise
    HAS_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SERIAL: tl.constexpr,  # IS_SPLIT: the last program of a tile reduces (else splitk_reduce)
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """M == 1: a [BLOCK_N, BLOCK_K / 8] tile of words is 8 nibble planes (plane i: k = 8j + i), each
    multiplied by x's matching strided slice in float32 FMAs; one K split per program along axis 1."""
    BW: tl.constexpr = BLOCK_K // 8
    offs_n, mask_n, rows_n, k_start, k_len = n_tile_k_split(N, K, K_PER_SPLIT, BLOCK_N)
    pdl_sync(USE_PDL)
    offs_w = tl.arange(0, BW)
    w_col = tl.multiple_of(k_start // 8, BW)  # lets aligned rows load BW words at a time
    if TILED_W:  # [N / BLOCK_N, KW / BW] tiles of BLOCK_N x BW words, each contiguous
        WSTEP: tl.constexpr = BLOCK_N * BW
        tile0 = tl.program_id(0).to(tl.int64) * (KW // BW) + w_col // BW
        w_ptrs = w_ptr + tile0 * WSTEP + tl.arange(0, BLOCK_N)[:, None] * BW + offs_w[None, :]
    else:
        WSTEP: tl.constexpr = BW
        w_ptrs = w_ptr + rows_n[:, None] * stride_wn + (w_col + offs_w)[None, :]
    x_ptrs = x_ptr + k_start
    s_rows = s_ptr + rows_n * stride_sn
    z_rows = z_ptr + rows_n * stride_zn
    if GROUP_STEPS == 0:  # channel-wise: one scale per row, applied after the loop
        s_row = tl.load(s_rows).to(tl.float32)
    # 2**23's bits (0x4B000000) in a register, not a constant the compiler can fold: each nibble then
    # takes one LOP3 ((words & mask) | magic) with the mask as its immediate.
    magic = tl.where(K > 0, 0x4B000000, 0)
    acc = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    for k0 in tl.range(0, k_len, BLOCK_K * SUB_STEPS, num_stages=NUM_STAGES):  # words prefetched via smem
        for sub in tl.static_range(SUB_STEPS):  # SUB_STEPS K steps: SUB_STEPS * BW contiguous words a row
            acc = _gemv_k_step(acc, w_ptrs + sub * WSTEP, x_ptrs + sub * BLOCK_K, s_rows, z_rows, magic,
                               k_start + k0 + sub * BLOCK_K, k_len - k0 - sub * BLOCK_K, w_col + k0 // 8 + sub * BW,
                               K, KW, stride_sg, stride_zg, BLOCK_K, GROUP_STEPS, HAS_ZP, EVEN_K, LOAD_ONLY)  # fmt: skip
        w_ptrs += WSTEP * SUB_STEPS
        x_ptrs += BLOCK_K * SUB_STEPS
    out = tl.sum(acc, axis=1)
    if GROUP_STEPS == 0:
        out *= s_row
    if IS_SPLIT:
        splitk_store(out, part_ptr + offs_n, N, mask_n, y_ptr + offs_n, bias_ptr + offs_n,
                     lock_ptr + tl.program_id(0), SPLIT_K, HAS_BIAS, SERIAL)  # fmt: skip
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


def tile_words(w_packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """w_packed [N, KW] with each [block_n, block_k / 8] tile contiguous, tiles in (N tile, K step)
    order: the layout a W4A16Config(tiled_w=True) gemv reads (bench_quant's DRAM-locality probe).
    N must be a multiple of block_n and KW of block_k / 8."""
    n, kw = w_packed.shape
    bw = block_k // 8
    assert n % block_n == 0 and kw % bw == 0, f"{tuple(w_packed.shape)} is not whole {block_n}x{bw} tiles"
    return w_packed.view(n // block_n, block_n, kw // bw, bw).permute(0, 2, 1, 3).contiguous().view(n, kw)
