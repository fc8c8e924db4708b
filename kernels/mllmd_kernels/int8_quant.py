"""int8_quant: per-token symmetric int8 quantization of activations (the W8A8 GEMM's input).

x [M, K] (fp16 / bf16 / fp32) -> q int8 [M, K] and scale float32 [M, 1] with x ~= q * scale, with
compressed-tensors' rounding exactly (`int8_quant_ref`, also the W8A8 layers' torch path):
  scale = max|x_row| / 127.5 (a zero scale becomes float32 eps), q = round_half_even(clamp(x / scale,
  -128, 127)).
The divisions are correctly rounded (Triton's `/` is an approximate division on NVIDIA; see `_quant_row`) and
the rounding is to nearest even (adding and subtracting 1.5 * 2**23, exact for |v| <= 2**22), so the
kernel's q and scale equal the reference bit for bit. One program per row; a row of up to
`ONE_PASS_MAX_K` elements is held in registers, longer rows are read twice.

No host synchronisation: the launch depends only on shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import next_pow2, pdl_args, pdl_sync, tl, triton

INT8_RANGE_HALF = 127.5  # (127 - (-128)) / 2
FP32_EPS = float(torch.finfo(torch.float32).eps)
ONE_PASS_MAX_K = 16384
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: v + M - M rounds |v| < 2**22 to the nearest integer, ties to even


def int8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: x [M, K] -> (q int8 [M, K], scale float32 [M, 1]), symmetric per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    scale = amax / torch.full_like(amax, INT8_RANGE_HALF)  # a tensor divisor: correctly rounded on CUDA too
    scale = torch.where(scale == 0, torch.full_like(scale, FP32_EPS), scale)
    q = torch.clamp(xf / scale, -128.0, 127.0).round_().to(torch.int8)
    return q, scale


@triton.jit
def _quant_row(x, scale):
    """round_half_even(clamp(x / scale, -128, 127)) as int8, x / scale correctly rounded.

    The quotient is q0 = x * r with r = 1 / scale correctly rounded, then corrected by one fma
    residual: q = q0 + (x - q0 * scale) * r (two fmas), which is the correctly rounded quotient
    (Markstein) as long as the residual does not underflow, i.e. for |x| above about 2**-100 (a
    smaller x gives a quotient far below 0.5: q = 0 either way). Rows whose scale is below 2**-90
    take div_rn itself (one branch per row). Three float operations an element instead of div.rn's
    subroutine, which made the quantizing kernels markedly faster (NOTES.md)."""
    if scale < 8.077935669463161e-28:  # 2**-90
        v = tl.math.div_rn(x, scale)
    else:
        r = tl.math.div_rn(1.0, scale)
        q0 = x * r
        v = tl.fma(tl.fma(-q0, scale, x), r, q0)
    v = tl.minimum(tl.maximum(v, -128.0), 127.0)
    v = (v + 12582912.0) - 12582912.0  # _ROUND_MAGIC: round half to even
    return v.to(tl.int8)


@triton.jit
def int8_scale(amax):
    """The per-token scale from a row's max|x|: amax / 127.5 correctly rounded, zero -> float32 eps."""
    scale = tl.math.div_rn(amax, 127.5)  # INT8_RANGE_HALF
    return tl.where(scale == 0.0, 1.1920928955078125e-07, scale)  # FP32_EPS


@triton.jit
def row_int8_scale(x_row, K, BLOCK: tl.constexpr):
    """int8_scale of the float row x_row[0:K], its max|x| taken BLOCK elements at a time (exact)."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    return int8_scale(tl.max(amax, axis=0))


@triton.jit
def _int8_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] int8
    s_ptr,  # [M] float32
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = int8_scale(tl.max(tl.abs(x), axis=0))
        tl.store(q_row + offs, _quant_row(x, scale), mask=mask)
    else:
        scale = row_int8_scale(x_row, K, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quant_row(x, scale), mask=mask)
    tl.store(s_ptr + row, scale)


def int8_quant(
    x: torch.Tensor,  # [M, K]
    out: torch.Tensor | None = None,  # [M, K] int8
    scale: torch.Tensor | None = None,  # [M, 1] float32
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 quantization with Triton: (q int8 [M, K], scale float32 [M, 1])."""
    assert x.dim() == 2 and x.stride(1) == 1, "int8_quant needs a K-contiguous [M, K] x"
    m, k = x.shape
    if out is None:
        out = torch.empty((m, k), dtype=torch.int8, device=x.device)
    if scale is None:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    assert out.stride(1) == 1 and scale.is_contiguous()
    if m == 0:
        return out, scale
    one_pass = block_k is None and k <= ONE_PASS_MAX_K
    block = next_pow2(max(k, 16)) if one_pass else (block_k or 4096)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _int8_quant_kernel[(m,)](
        x, out, scale, k, x.stride(0), out.stride(0), BLOCK_K=block, ONE_PASS=one_pass, num_warps=num_warps,
        **pdl_args(x),
    )
    return out, scale
