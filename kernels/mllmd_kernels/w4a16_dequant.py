"""w4a16_dequant: the compressed-tensors W4A16 weight format, its torch references, and
`w4a16_dequantize` (the weight once in the activation dtype, for prefills that multiply with cuBLAS).

Weights as compressed-tensors packs them ("pack-quantized"): `w_packed` int32 [N, ceil(K / 8)], eight
4-bit values per word along K, value i of a word in bits [4i, 4i + 4), stored as q + 8; `w_scale`
float32 [N, G] (one scale per group of K / G columns; G = 1 is channel-wise); `w_zero_point` int8
[N, G] in [-8, 7] (unpacked; asymmetric schemes only). w = (q - zero_point) * scale.
The packed words are read as stored, or in `w4a16_mma.tile_order` (`mma_vec`). Scales may also be
bf16 / fp16 (SCALE_DTYPES; widened to float32 on load). Scales and zero points may have any strides:
a column-major [N, G] (`.t().contiguous().t()`, what TritonW4A16Kernel keeps) makes each K step's
BLOCK_N scales one contiguous read.

`w4a16_dequantize` and the tensor-core GEMM paths (`w4a16_gemm`) widen a [BLOCK_N, BLOCK_K / 8] tile
of words to [BLOCK_N, BLOCK_K] in registers (`tl.interleave` three times, `_dequant_f32`); each lane
shifts out its nibble and ORs it into the mantissa of 2**23 (int -> float without a conversion
instruction), so w = (f - (2**23 + 8 + zero_point)) * scale in float32, exactly as the reference
computes it before its rounding to the activation dtype. BLOCK_K divides the group size, so one K
step reads one scale per row.
"""

from __future__ import annotations

import torch

from mllmd_kernels import knobs
from mllmd_kernels._triton import HAS_TRITON, cdiv, interpreting, tl, triton
from mllmd_kernels.w4a16_config import group_block_k

# Scale dtypes the kernels read (each widened to float32 on load, so a bf16 scale that holds the
# float32 value exactly gives the same products). TritonW4A16Kernel keeps a layer's scales in float32
# all the same: with bf16 scales the one-row gemv is slower, its 2-byte scale loads not prefetched
# through the cp.async pipeline as the 4-byte ones are (NOTES.md).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


# DEQUANT modes of the tensor-core tilings (`dequant_mode`): the weight tile in float32 then rounded
# (`_dequant_f32`); or built from its eight nibble planes in the activation dtype (`_dequant_planes`),
# each plane by Triton ops (float32, rounded: any scales) or by packed 16-bit arithmetic in PTX
# (scales exact in the activation dtype: the same bits, about a quarter of the instructions).
DEQUANT_F32, DEQUANT_PLANES, DEQUANT_PLANES_PTX = 0, 1, 2


def dequant_mode(x: torch.Tensor, exact_scales: bool) -> int:
    """How the tensor-core tilings dequantize for activations like `x`, given whether the scales hold
    values exact in x's dtype (`scales_exact_in`): the nibble planes for a 16-bit x and exact scales
    (else, or with MLLMD_W4A16_PLANES=0, the float32 path, which rounds once as the reference does);
    in PTX where the kernel is compiled, in Triton ops under the interpreter."""
    if not (exact_scales and knobs.w4a16_planes()) or x.dtype not in (torch.bfloat16, torch.float16):
        return DEQUANT_F32
    return DEQUANT_PLANES if interpreting() else DEQUANT_PLANES_PTX


def scales_exact_in(w_scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every scale is a value of `dtype` (a bf16 checkpoint's scales widened to float32 are), so that
    (q - zero_point) * scale, exact in float32, rounds to the same `dtype` value from either side.
    One device synchronisation: call it at load."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    s = w_scale.float()
    return bool(torch.equal(s.to(dtype).float(), s))


@triton.jit
def _pair_bits(v, DTYPE: tl.constexpr):
    """[R] float32 -> int32 holding v in `DTYPE` in both 16-bit halves (a packed x2 operand)."""
    b = v.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


def _planes_asm(magic2: int, one2: int, fma: str) -> str:
    """PTX for `_planes_ptx`: the eight nibble planes of one int32 word ($8) as 16-bit floats ($0..$7),
    given -(MAGIC + 8 + zero point) ($9) and the scale ($10) as packed pairs. The bytes of the word and
    of the word shifted by 4 are paired (PRMT) so that nibbles 2i and 2i + 1 sit 16 bits apart, one LOP3
    ORs both into the mantissa of MAGIC (`magic2`: 128 in bf16, 1024 in fp16, twice: exact), one packed
    FMA subtracts the offset (an exact small integer), one multiplies by the scale (one rounding, as the
    reference's); each output pair is in the order the planes' join wants."""
    pairs = "".join(f"            prmt.b32 t{i}, $8, u, 0x0{4 + i}0{i};\n" for i in range(4))
    lops = "".join(f"            lop3.b32 t{i}, t{i}, 0x000F000F, 0x{magic2:08X}, 0xEA;\n" for i in range(4))
    subs = "".join(f"            {fma} t{i}, t{i}, one, $9;\n" for i in range(4))
    muls = "".join(f"            {fma} t{i}, t{i}, $10, nz;\n" for i in range(4))
    outs = "".join(f"            mov.b32 {{${2 * i}, ${2 * i + 1}}}, t{i};\n" for i in range(4))
    return (
        "{\n            .reg .b32 t0, t1, t2, t3, u, one, nz;\n"
        f"            mov.b32 one, 0x{one2:08X};\n            mov.b32 nz, 0x80008000;\n"
        f"            shr.u32 u, $8, 4;\n{pairs}{lops}{subs}{muls}{outs}            }}"
    )


if HAS_TRITON:  # the kernels' compile-time constants (without Triton the kernels are stubs)
    _PLANES_BF16 = tl.constexpr(_planes_asm(0x43004300, 0x3F803F80, "fma.rn.bf16x2"))
    _PLANES_FP16 = tl.constexpr(_planes_asm(0x64006400, 0x3C003C00, "fma.rn.f16x2"))
    _PLANES_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")  # eight 16-bit outputs, three words in
    _PLANES_BF16_OUT = tl.constexpr((tl.bfloat16,) * 8)
    _PLANES_FP16_OUT = tl.constexpr((tl.float16,) * 8)


@triton.jit
def _planes_ptx_bf16(words, neg_offset2, scale2):
    """The eight nibble planes of int32 `words` as bf16: plane j = (nibble j + MAGIC - (MAGIC + 8 +
    zero point)) * scale, by `_planes_asm`'s PTX. `neg_offset2` / `scale2`: -(MAGIC + 8 + zero point)
    and the scale as packed pairs."""
    return tl.inline_asm_elementwise(_PLANES_BF16, _PLANES_CONSTRAINTS, [words, neg_offset2, scale2], _PLANES_BF16_OUT,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _planes_ptx_fp16(words, neg_offset2, scale2):
    """`_planes_ptx_bf16` for fp16."""
    return tl.inline_asm_elementwise(_PLANES_FP16, _PLANES_CONSTRAINTS, [words, neg_offset2, scale2], _PLANES_FP16_OUT,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _plane(words, j: tl.constexpr, off, s, DTYPE: tl.constexpr):
    """Nibble plane j of `words` as (nibble - off) * s in float32, rounded to DTYPE (any scales)."""
    return ((((words >> (4 * j)) & 0xF).to(tl.float32) - off[:, None]) * s[:, None]).to(DTYPE)


@triton.jit
def _dequant_planes(
    w_ptrs,  # [BLOCK_N, BLOCK_K // 8] pointers to packed words
    word_mask,  # [BLOCK_K // 8] (unused when EVEN_K)
    s_ptrs,  # [BLOCK_N] scales of this K step's group
    z_ptrs,  # [BLOCK_N] zero points (HAS_ZP)
    BLOCK_K: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    DTYPE: tl.constexpr,  # the activations' (bf16 / fp16)
    PTX: tl.constexpr,
):
    """(q - zero_point) * scale as DTYPE [BLOCK_N, BLOCK_K], equal to `_dequant_f32` rounded to DTYPE
    (with PTX: for scales exact in DTYPE). The eight planes (nibble j of every word: columns 8c + j)
    are made apart and joined three times, so that no word is shifted by a per-column amount."""
    if EVEN_K:
        words = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        words = tl.load(w_ptrs, mask=word_mask[None, :], other=0, eviction_policy="evict_first")
    s = tl.load(s_ptrs).to(tl.float32)
    if HAS_ZP:
        off = 8.0 + tl.load(z_ptrs).to(tl.float32)
    else:
        off = tl.zeros_like(s) + 8.0
    if PTX:
        if DTYPE == tl.float16:
            magic = 1024.0
        else:
            magic = 128.0
        neg_offset2 = _pair_bits(-(magic + off), DTYPE)[:, None]
        scale2 = _pair_bits(s, DTYPE)[:, None]
        if DTYPE == tl.float16:
            p0, p1, p2, p3, p4, p5, p6, p7 = _planes_ptx_fp16(words, neg_offset2, scale2)
        else:
            p0, p1, p2, p3, p4, p5, p6, p7 = _planes_ptx_bf16(words, neg_offset2, scale2)
    else:
        p0 = _plane(words, 0, off, s, DTYPE)
        p1 = _plane(words, 1, off, s, DTYPE)
        p2 = _plane(words, 2, off, s, DTYPE)
        p3 = _plane(words, 3, off, s, DTYPE)
        p4 = _plane(words, 4, off, s, DTYPE)
        p5 = _plane(words, 5, off, s, DTYPE)
        p6 = _plane(words, 6, off, s, DTYPE)
        p7 = _plane(words, 7, off, s, DTYPE)
    # join's new axis is the last: the innermost joins pick bit 2 of j, the outermost bit 0, so that
    # the reshape puts plane j of word c at column 8c + j
    w = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    return tl.reshape(w, (words.shape[0], BLOCK_K))


@triton.jit
def _dequant_tile(
    w_ptrs, word_mask, s_ptrs, z_ptrs, BLOCK_K: tl.constexpr, HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr,
    DTYPE: tl.constexpr, DEQUANT: tl.constexpr,
):
    """The tensor-core tilings' weight tile [BLOCK_N, BLOCK_K] in DTYPE, the reference's dequantized
    weight: by `_dequant_f32` and a rounding (DEQUANT 0), or from the nibble planes (1: Triton ops, 2:
    PTX; `dequant_mode`), the same bits."""
    if DEQUANT == 0:
        w = _dequant_f32(w_ptrs, word_mask, s_ptrs, z_ptrs, BLOCK_K, HAS_ZP, EVEN_K).to(DTYPE)
    else:
        w = _dequant_planes(w_ptrs, word_mask, s_ptrs, z_ptrs, BLOCK_K, HAS_ZP, EVEN_K, DTYPE, DEQUANT == 2)
    return w


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


def _check_mma_order(w_packed: torch.Tensor, mma_vec: int) -> None:
    """Words in w4a16_mma.tile_order come as whole 16-row tiles and 256-column stages, contiguous."""
    if mma_vec:
        n, kw = w_packed.shape
        assert mma_vec in (1, 2, 4) and n % 16 == 0 and kw % 32 == 0 and w_packed.is_contiguous(), (
            f"w_packed {tuple(w_packed.shape)} cannot be in mma tile order (vec {mma_vec})"
        )


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
