"""w4a16_gemm: y = x W^T with int4 weights dequantized inside the kernel (compressed-tensors W4A16).

Weights as compressed-tensors packs them ("pack-quantized"): `w_packed` int32 [N, ceil(K / 8)], eight
4-bit values per word along K, value i of a word in bits [4i, 4i + 4), stored as q + 8; `w_scale`
float32 [N, G] (one scale per group of K / G columns; G = 1 is channel-wise); `w_zero_point` int8
[N, G] in [-8, 7] (unpacked; asymmetric schemes only). w = (q - zero_point) * scale.
The packed words are read as stored. Scales may also be bf16 / fp16 (SCALE_DTYPES; widened to float32
on load). Scales and zero points may have any strides: a column-major
[N, G] (`.t().contiguous().t()`, what TritonW4A16Kernel keeps) makes each K step's BLOCK_N scales
one contiguous read.

The tensor-core paths and `w4a16_dequantize` widen a [BLOCK_N, BLOCK_K / 8] tile of words to
[BLOCK_N, BLOCK_K] in registers (`tl.interleave` three times); each lane shifts out its nibble and
ORs it into the mantissa of 2**23 (int -> float without a conversion instruction), so
w = (f - (2**23 + 8 + zero_point)) * scale in float32, exactly as the reference computes it before
its rounding to the activation dtype. BLOCK_K divides the group size, so one K step reads one scale
per row.

M == 1 (`_w4a16_gemv_kernel`) is bound by instructions, not bytes (an H200 streams ~8e12 int4 weights/s
and issues ~33e12 instructions/s), so it never widens: the word tile is 8 nibble planes (plane i holds
k = 8j + i of word column j) and a weight costs three instructions. One LOP3 puts the nibble into
2**23's mantissa where it lies: (word & 0xF << s) | 0x4B000000 = 2**23 + n * 2**s as a float (s = 4i
for planes 0..4, s = 4i - 16 in word >> 16 for planes 5..7: one shift per word); one FMA scales by
2**-s and subtracts 2**(23 - s) + 8 + zero_point, giving q - zero_point exactly; one FMA multiplies by
x[8j + i] into a float32 partial. Once per K step the partial is multiplied by the row's scale
(channel-wise: once, at the end). Per K step x's planes come from one [BLOCK_K / 8, 8] load split
with tl.split, and the words are prefetched NUM_STAGES steps ahead through shared memory (cp.async).
Tried and slower on the H200: a tensor-core one-row kernel (each nibble pair dequantized by one LOP3 and
one bf16x2 FMA straight into the MMA operand, 3.2 instructions a weight; 22d8b63, reverted) took
1.4-1.6x this kernel's time on every Qwen3-8B shape (shared-memory round trips, 6 barriers a K step).

Large M (`prefers_dequant`: 256 rows and up, or 128 where the fused tiling has too few tiles):
`w4a16_dequantize` writes the weight once in the activation
dtype and cuBLAS multiplies; a fused tile would otherwise dequantize every weight tile once per M tile.

Tilings by M (`pick_w4a16_config`, no autotuning):
* "gemv" (M == 1): no tensor cores, float32 FMAs on the nibble planes (above);
* "skinny" (2 <= M <= 64): acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T on tensor cores with W
  dequantized to the activation dtype (x padded to 16+ rows);
* "gemm" (prefill): acc[BLOCK_M, BLOCK_N] = x_tile @ W_tile^T with a GROUP_M swizzle.
"gemv" and "skinny" split K until every SM has a few tiles, writing float32 partials
[SPLIT_K, M, N] that are added in a fixed split order (deterministic): given the layer's counters
(`splitk_counters`), by the last program of each output tile to finish (one atomic per program, no
second launch); otherwise by `splitk_reduce`.
The weight dequantized for the tensor-core paths equals the reference's bit for bit on the GPU
(the gemv path keeps it in float32, which is slightly more accurate); sums differ by order only.

No host synchronisation: the launches depend only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from mllmd_kernels import knobs
from mllmd_kernels._triton import cdiv, dot_in_fp32, next_pow2, pdl_args, pdl_sync, sm_count_for, tl, triton
from mllmd_kernels.splitk import auto_split, k_splits, splitk_reduce, splitk_store
from mllmd_kernels.tiling import fit_stages, max_shared_memory, n_tile_k_split, swizzled_tile


def unpack_int4_ref(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [R, ceil(cols / 8)] -> int8 [R, cols] in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, W, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def pack_int4_ref(values: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] in [-8, 7] -> int32 [R, ceil(C / 8)] (the inverse of unpack_int4_ref; pads with 0 bits)."""
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64, device=values.device)
    padded[:, :cols] = values.to(torch.int64) + 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (padded.view(rows, -1, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_int4_ref(
    w_packed: torch.Tensor,  # [N, ceil(K / 8)] int32
    w_scale: torch.Tensor,  # [N, G] float32
    w_zero_point: torch.Tensor | None,  # [N, G] int8, None when symmetric
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[N, K] `dtype`: (q - zero_point) * scale in float32, then rounded to `dtype`."""
    n, groups = w_scale.shape
    q = unpack_int4_ref(w_packed, in_features).view(n, groups, in_features // groups).float()
    if w_zero_point is not None:
        q = q - w_zero_point.float().unsqueeze(-1)
    return (q * w_scale.float().unsqueeze(-1)).reshape(n, in_features).to(dtype)


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


# Where dequantizing W once and calling cuBLAS beats the fused "gemm" tiling (`prefers_dequant`): on
# an H200 the fused kernel ran the Qwen3-8B projections at M = 2,048 in 1.9-2.3x cuBLAS's bf16 time,
# while dequantizing is one pass over the weights (N*K/2 bytes read, N*K*2 written). At M = 128 the
# fused / dequantized times were qkv 50.6 / 37.9 us, o 51.9 / 26.2, gate_up 105 / 150, down 147 / 77
# (bench_quant --m 128 256): the fused tiling wins only where it has enough tiles to fill the GPU
# (gate_up: 384 tiles on 132 SMs; the others 64-96). At 256 rows dequantizing won or tied on all four.
DEQUANT_MIN_ROWS = 128  # below: always the fused kernels
DEQUANT_ALWAYS_ROWS = 256  # from here: always dequantize + cuBLAS


def prefers_dequant(x: torch.Tensor, n: int, group: int) -> bool:
    """x [M, K] @ W[n, K]^T is faster dequantized + cuBLAS than in the fused kernel: from
    DEQUANT_ALWAYS_ROWS rows, and from DEQUANT_MIN_ROWS where the fused tiling has fewer than two
    output tiles per SM of x's device."""
    m, k = x.shape
    if m < DEQUANT_MIN_ROWS:
        return False
    if m >= DEQUANT_ALWAYS_ROWS:
        return True
    sms = sm_count_for(x)
    cfg = pick_w4a16_config(m, n, k, group, sms, max_shared_memory(x))
    return cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n) < 2 * sms


@dataclass(frozen=True)
class W4A16Config:
    mode: str  # "gemv" (M == 1, no tensor cores) | "skinny" (W @ x^T, split-K) | "gemm" (swizzled tiles)
    block_m: int
    block_n: int
    block_k: int  # reduced at launch to a power of two that divides the group size
    group_m: int
    split_k: int
    num_warps: int
    num_stages: int
    sub_steps: int = 1  # "gemv": K steps per loop trip (sub_steps * block_k / 2 contiguous bytes a row)
    # Bench-only probes of the "gemv" tiling (bench_quant's DRAM-locality experiment; never picked):
    tiled_w: bool = False  # w_packed laid out by `tile_words` (each program's K-step tile contiguous)
    load_only: bool = False  # one FMA a word instead of the nibble planes (wrong sums: a bandwidth probe)


def group_block_k(block_k: int, group: int, k: int) -> int:
    """The K step for `group` columns per scale: <= block_k, a power of two >= 16 dividing the group
    (channel-wise: any, K is masked)."""
    if group >= k:  # channel-wise
        return max(16, min(block_k, next_pow2(k)))
    bk = block_k
    while group % bk:
        bk //= 2
    assert bk >= 16, f"group size {group} is not a multiple of 16"
    return bk


@functools.lru_cache(maxsize=1)
def tuned_gemv_configs() -> dict[tuple[int, int], W4A16Config]:
    """One-row tilings by (N, K) from the JSON file `$MLLMD_W4A16_TUNED` names (what
    `bench_quant --sweep w4a16 --w4a16-tuned-out FILE` writes: {"N,K": config fields}); {} unset."""
    path = knobs.w4a16_tuned_path()
    if not path:
        return {}
    with open(path) as f:
        raw = json.load(f)
    out = {}
    for key, fields in raw.items():
        cfg = W4A16Config(**fields)
        if cfg.mode != "gemv" or cfg.block_m != 1:
            raise ValueError(f"{path}: {key}: not a one-row gemv tiling: {fields}")
        if cfg.tiled_w or cfg.load_only:  # bench probes: another weight layout, or wrong sums
            raise ValueError(f"{path}: {key}: tiled_w / load_only are bench probes, not tilings: {fields}")
        n, k = (int(v) for v in key.split(","))
        out[(n, k)] = cfg
    return out


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked on every launch
def pick_w4a16_config(m: int, n: int, k: int, group: int, num_sms: int, smem: int) -> W4A16Config:
    """Tile sizes for x[m, k] @ W[n, k]^T by M (decode / prefill), fitted to shared memory."""
    if m == 1 and (n, k) in tuned_gemv_configs():
        return tuned_gemv_configs()[(n, k)]
    if m == 1:
        # ALU-bound: a K step of 64 rows x 128 columns per program at 2 warps (16 words per thread; the
        # x planes are shared by the rows, the row scale by the words), prefetched 4 steps deep through
        # shared memory; K split until there are about 6 programs per SM. The best of the bench_quant
        # sweep on the Qwen3-8B shapes (H200): 9.8 / 7.9 / 22.8 / 14.1 us for qkv / o / gate_up / down,
        # against 12.8 / 10.4 / 28.7 / 20.1 us for 128 rows at 4 warps, 3 stages.
        bk = group_block_k(256 if group >= k else 128, group, k)
        bn = max(16, min(512, 8192 // bk, next_pow2(n)))
        split = auto_split(cdiv(n, bn), k, bk, num_sms, ctas_per_sm=6, min_blocks=2)
        return W4A16Config("gemv", 1, bn, bk, 1, split, 2, fit_stages(bn * bk // 2, 4, smem))
    if m <= 64:
        bm, bn, bk = max(16, next_pow2(m)), 64, group_block_k(128, group, k)
        split = auto_split(cdiv(n, bn), k, bk, num_sms, ctas_per_sm=2, min_blocks=2)
        return W4A16Config("skinny", bm, bn, bk, 1, split, 4, fit_stages(bm * bk * 2 + bn * bk // 2, 4, smem))
    if m <= 128:
        bm, bn, warps = 64, 128, 4
    else:
        bm, bn, warps = 128, 128, 8
    bk = group_block_k(64, group, k)
    return W4A16Config("gemm", bm, bn, bk, 8, 1, warps, fit_stages(bm * bk * 2 + bn * bk // 2, 4, smem))


@triton.jit
def _dequant_f32(
    w_ptrs,  # [BLOCK_N, BLOCK_K // 8] pointers to packed words
    word_mask,  # [BLOCK_K // 8] (unused when EVEN_K)
    s_ptrs,  # [BLOCK_N] scales of this K step's group
    z_ptrs,  # [BLOCK_N] zero points (HAS_ZP)
    BLOCK_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """(q - zero_point) * scale as float32 [BLOCK_N, BLOCK_K]."""
    if EVEN_K:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        words = tl.load(w_ptrs, mask=word_mask[None, :], other=0, eviction_policy="evict_first")
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)  # column c holds word c // 8
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    f = (((words >> shifts[None, :]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + nibble
    s = tl.load(s_ptrs).to(tl.float32)
    if HAS_ZP:
        f = f - (8388616.0 + tl.load(z_ptrs).to(tl.float32))[:, None]  # 2**23 + 8 + zero point
    else:
        f = f - 8388616.0
    return f * s[:, None]


@triton.jit
def _word_offsets(rows, wcols, stride_wn, MMA_VEC: tl.constexpr):
    """Offsets of the words (rows[:, None], wcols[None, :]) of w_packed: row-major as stored
    (MMA_VEC == 0), or in w4a16_mma.tile_order(w, MMA_VEC) (16-row tiles, 256-column stages, chunks of
    4 * MMA_VEC words; rows 16 apart are 16 * stride_wn words apart there too)."""
    if MMA_VEC == 0:
        return rows[:, None] * stride_wn + wcols[None, :]
    else:
        row_off = (rows // 16) * 16 * stride_wn + ((rows % 16) // 8) * (32 * MMA_VEC) + (rows % 8) * (4 * MMA_VEC)
        col_off = (wcols // 32) * 512 + ((wcols % 32) // (4 * MMA_VEC)) * (64 * MMA_VEC) + wcols % (4 * MMA_VEC)
        return row_off[:, None] + col_off[None, :]


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
        g = (k_start + k0) // GROUP
        word_mask = (k_start + k0) // 8 + offs_w < KW
        f = _dequant_f32(w_ptrs, word_mask, s_rows + g * stride_sg, z_rows + g * stride_zg,
                         BLOCK_K, HAS_ZP, EVEN_K)  # fmt: skip
        w = f.to(x_ptr.dtype.element_ty)  # the reference's dequantized weight
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
        g = k0 // GROUP
        word_mask = k0 // 8 + offs_w < KW
        f = _dequant_f32(w_ptrs, word_mask, s_rows + g * stride_sg, z_rows + g * stride_zg,
                         BLOCK_K, HAS_ZP, EVEN_K)  # fmt: skip
        w = f.to(x_ptr.dtype.element_ty)
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


@triton.jit
def _w4a16_dequant_kernel(
    w_ptr,  # [N, KW] int32
    s_ptr,  # [N, G] float32 / bf16 / fp16
    z_ptr,  # [N, G] int8 (HAS_ZP)
    out_ptr,  # [N, K]
    N,
    K,
    KW,
    GROUP,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    MMA_VEC: tl.constexpr = 0,  # w_packed in w4a16_mma.tile_order (0: row-major)
):
    """One [BLOCK_N, BLOCK_K] tile of the dequantized weight (BLOCK_K divides the group)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rows = (offs_n % N).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_K // 8)
    w_ptrs = w_ptr + _word_offsets(rows, k0 // 8 + offs_w, stride_wn, MMA_VEC)
    g = k0 // GROUP
    word_mask = k0 // 8 + offs_w < KW
    f = _dequant_f32(w_ptrs, word_mask, s_ptr + rows * stride_sn + g * stride_sg,
                     z_ptr + rows * stride_zn + g * stride_zg, BLOCK_K, HAS_ZP, EVEN_K)  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    tl.store(
        out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :],
        f.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def w4a16_dequantize(
    w_packed: torch.Tensor,  # [N, ceil(K / 8)] int32
    w_scale: torch.Tensor,  # [N, G] float32 / bf16 / fp16 (any strides)
    w_zero_point: torch.Tensor | None,  # [N, G] int8
    in_features: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # [N, K] dtype
    mma_vec: int = 0,  # w_packed in w4a16_mma.tile_order(w, mma_vec) (0: row-major as stored)
) -> torch.Tensor:
    """The weight [N, K] in `dtype`, equal to dequantize_int4_ref (float32 math, one rounding)."""
    n, kw = w_packed.shape
    k = in_features
    assert w_packed.dtype == torch.int32 and w_packed.stride(1) == 1 and kw == cdiv(k, 8)
    _check_mma_order(w_packed, mma_vec)
    group = k // w_scale.shape[1]
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w_packed.device)
    bk = group_block_k(64, group, k)
    zp = w_zero_point if w_zero_point is not None else w_scale
    grid = (cdiv(n, 64), cdiv(k, bk))
    _w4a16_dequant_kernel[grid](
        w_packed, w_scale, zp, out, n, k, kw, group, w_packed.stride(0), w_scale.stride(0), w_scale.stride(1),
        zp.stride(0), zp.stride(1), out.stride(0),
        BLOCK_N=64, BLOCK_K=bk, HAS_ZP=w_zero_point is not None, EVEN_K=k % bk == 0, MMA_VEC=mma_vec, num_warps=4,
    )  # fmt: skip
    return out


def _check_mma_order(w_packed: torch.Tensor, mma_vec: int) -> None:
    """Words in w4a16_mma.tile_order come as whole 16-row tiles and 256-column stages, contiguous."""
    if mma_vec:
        n, kw = w_packed.shape
        assert mma_vec in (1, 2, 4) and n % 16 == 0 and kw % 32 == 0 and w_packed.is_contiguous(), (
            f"w_packed {tuple(w_packed.shape)} cannot be in mma tile order (vec {mma_vec})"
        )


# Scale dtypes the kernels read (each widened to float32 on load, so a bf16 scale that holds the
# float32 value exactly gives the same products). TritonW4A16Kernel keeps a layer's scales in float32
# all the same: with bf16 scales the one-row gemv was 21% slower on the H200 (Qwen3-8B batch-1 decode
# step 3.174 against 2.623 ms, same call): its 2-byte scale loads are not prefetched through the
# cp.async pipeline as the 4-byte ones are (the sm90 SASS of the K loop has an LDG.E.U16 waited on
# every step, where float32 scales come in by LDGSTS with the words).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tile_words(w_packed: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """w_packed [N, KW] with each [block_n, block_k / 8] tile contiguous, tiles in (N tile, K step)
    order: the layout a W4A16Config(tiled_w=True) gemv reads (bench_quant's DRAM-locality probe).
    N must be a multiple of block_n and KW of block_k / 8."""
    n, kw = w_packed.shape
    bw = block_k // 8
    assert n % block_n == 0 and kw % bw == 0, f"{tuple(w_packed.shape)} is not whole {block_n}x{bw} tiles"
    return w_packed.view(n // block_n, block_n, kw // bw, bw).permute(0, 2, 1, 3).contiguous().view(n, kw)


def splitk_counter_len(n: int) -> int:
    """How many split-K counters a layer of N outputs needs: one per output tile of the narrowest
    (16-column) tiling any decode config picks."""
    return cdiv(n, 16)


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
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) -> [M, N] in x's dtype, float32 accumulation; int4 unpacked in-kernel.

    Words in mma tile order (`mma_vec`) take the skinny and gemm tilings only: one row runs the
    skinny tiling instead of the gemv (whose loads and probes are built on row-major words).

    With `splitk_counters` a split-K launch reduces its own partials (the last program of each tile
    adds them) instead of launching `splitk_reduce`. The counters return to 0 after every
    launch; two launches must not share them at the same time (one set per layer, one stream)."""
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
            DOT_F32=dot_in_fp32(x.dtype), EVEN_K=even_k, MMA_VEC=mma_vec,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x),
        )  # fmt: skip
    if split > 1 and not serial:
        splitk_reduce(part, out, bias)
    return out
