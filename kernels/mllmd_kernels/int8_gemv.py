"""int8_gemv: the W8A8 GEMM of one row (decode at batch 1), without tensor cores.

    y[n] = float(sum_k a[k] * b[n, k]) * a_scale * b_scale[n] (+ bias[n]), in out_dtype

Each program streams [BLOCK_N, BLOCK_K] int8 weight tiles (16-byte loads, evict-first) and
multiply-adds them with the int8 row, keeping per-thread int32 partial sums that are reduced over K
once at the end: by default as int32 words of four bytes, one `dp4a` instruction per word (sm61 and
newer, so Orin too; in the interpreter the same sum by shifts), else widened to int32 (one sign
extension and one IMAD per weight). Exact in int32; the epilogue is `int8_gemm`'s; split K takes
`splitk_reduce`.

`w8a8_gemv` (what `w8a8_linear` runs for one row) fuses the per-token quantization into the gemv:
every program takes max|x| over the whole row (at most a few tens of KB, L2-resident) and quantizes
its own x slices with `int8_quant`'s code, so q and the scale equal `int8_quant`'s bit for bit and
the output equals int8_quant + int8_gemm's bit for bit, in one launch instead of two.
With `silu_mul` (`int8_gemm_silu_mul`, a W8A8 gate/up projection of one row) the epilogue pairs each
gate output with its up output and stores silu(gate) * up: silu_and_mul(int8_gemm(...)) bit for bit,
without the second launch.

No host synchronisation: the launches depend only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

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
from mllmd_kernels.activation import _silu_mul
from mllmd_kernels.int8_config import Int8GemmConfig, pick_int8_config
from mllmd_kernels.int8_quant import _quant_row, int8_scale, row_int8_scale
from mllmd_kernels.splitk import k_splits, splitk_reduce
from mllmd_kernels.tiling import k_step_loads, max_shared_memory, n_tile_k_split

GEMV_SCALE_BYTES = 16384  # w8a8_gemv: bytes of x per step of each program's max|x| pass


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


def int8_gemv(
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
    """Launch `_int8_gemv_kernel` (+ the split-K reduce and epilogue) for one row."""
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
    return int8_gemv(x, weight, None, weight_scale, bias, out, cfg, fuse_quant=True, amax_in=amax_parts)
