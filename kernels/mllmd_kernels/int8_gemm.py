"""int8_gemm: int8 x int8 -> int32 GEMM with per-token and per-channel scales in the epilogue (the
W8A8 linear layer); int8 tensor cores from 2 rows on, the integer gemv (`int8_gemv`) for one row.

    y[m, n] = float(sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]), in out_dtype

a: int8 [M, K] activations (from `int8_quant`), b: int8 [N, K] weights exactly as compressed-tensors
stores them. K-major on both sides is the layout int8 MMA wants (mma.sync on sm80/sm87 and wgmma
on sm90 take 8-bit operands K-major only), so the weights are used as stored: no re-layout.
The accumulation is exact in int32 (|sum| < 2**31 for K < 2**17 at full range); the scaling is in
float32 in the reference's order ((acc * a_scale) * b_scale + bias), then one rounding to out_dtype.

The tilings are `int8_config`'s. "skinny" splits K where there are too few tiles for the SMs, with
int32 partial sums [SPLIT_K, M, N] that `splitk_reduce` adds before the epilogue (exact and
deterministic: no atomics, no memset).
Nothing Hopper-only is on the default path of other GPUs (no TMA, no warp specialisation); Triton
lowers tl.dot to wgmma on sm90 and to mma.sync on sm80/sm87 by itself, and the gemv is plain loads
and integer arithmetic (dp4a exists since sm61). On sm90, prefills of TMA_MIN_ROWS rows and more
fetch their tiles by TMA instead (int8_gemm_tma), chosen by capability (`tma_supported`).

No host synchronisation: the launches depend only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import cdiv, pdl_args, pdl_sync, sm_count_for, tl, triton
from mllmd_kernels.activation import silu_and_mul
from mllmd_kernels.int8_config import TMA_MIN_ROWS, TMA_MODES, Int8GemmConfig, pick_int8_config
from mllmd_kernels.int8_gemv import int8_gemv, w8a8_gemv
from mllmd_kernels.int8_quant import int8_quant, int8_quant_ref
from mllmd_kernels.splitk import k_splits, splitk_reduce
from mllmd_kernels.tiling import k_step_loads, max_shared_memory, n_tile_k_split, swizzled_tile

_int_mm_works: dict[str, bool] = {}  # device type -> torch._int_mm runs there


def int_mm_available(device: torch.device) -> bool:
    """Whether torch._int_mm runs on this device type; probed once (a host sync: call it at load)."""
    key = device.type
    if key not in _int_mm_works:
        try:
            a = torch.ones(32, 32, dtype=torch.int8, device=device)
            _int_mm_works[key] = bool(torch._int_mm(a, a)[0, 0].item() == 32)
        except (RuntimeError, AttributeError, NotImplementedError):
            _int_mm_works[key] = False
    return _int_mm_works[key]


def int8_mm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [N, K]^T -> int32 [M, N], exactly (as the kernels' int32 accumulators).

    torch._int_mm where the device has it (CUDA only for M > 16 and K, N multiples of 8); else the
    products summed in float64, which holds every int8 dot product of K < 2**38 exactly."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0:
        return torch.zeros(0, n, dtype=torch.int32, device=a.device)
    shapes_ok = a.device.type != "cuda" or (m > 16 and k % 8 == 0 and n % 8 == 0)
    if shapes_ok and int_mm_available(a.device):
        return torch._int_mm(a.contiguous(), b.t())
    return torch.matmul(a.double(), b.double().t()).to(torch.int32)


def int8_gemm_ref(
    a: torch.Tensor,  # [M, K] int8
    b: torch.Tensor,  # [N, K] int8
    a_scale: torch.Tensor,  # [M, 1] float32
    b_scale: torch.Tensor,  # [N, 1] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Torch reference (and the W8A8 layer's torch path): the integer products summed exactly
    (`int8_mm_ref`), then (acc * a_scale) * b_scale (+ bias) in float32, rounded to out_dtype."""
    acc = int8_mm_ref(a, b).float()  # float32(int32 accumulator): one rounding
    out = acc * a_scale.float().view(-1, 1) * b_scale.float().view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of the W8A8 linear: per-token int8 x [..., K] (`int8_quant_ref`), int8 weight
    [N, K] with its scale [N, 1] -> [..., N] x.dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = int8_quant_ref(x2)
    out = int8_gemm_ref(q, weight, s, weight_scale, x.dtype, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


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
        return int8_gemv(a, b, a_scale, b_scale, bias, out, cfg, fuse_quant=False)
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
            int8_gemv(a, b, a_scale, b_scale, bias, out, cfg, fuse_quant=False, silu_mul=True, amax_out=parts)
            return out, parts
    return silu_and_mul(int8_gemm(a, b, a_scale, b_scale, out_dtype, bias, config=config)), None


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
    fused launch is also the faster one where there are few weight tiles per SM (NOTES.md)."""
    if x.shape[0] == 1 and (config is None or config.mode == "gemv"):
        return w8a8_gemv(x, weight, weight_scale, bias, config=config, amax_parts=amax_parts)
    q, s = int8_quant(x)
    return int8_gemm(q, weight, s, weight_scale, x.dtype, bias, config=config)
