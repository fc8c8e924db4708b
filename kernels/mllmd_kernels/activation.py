"""silu_and_mul: silu(gate) * up over a fused [..., 2 * d] gate/up projection output.

Numerics as mllmd/models/layers/activation.py in torch: silu computed in fp32 and rounded to the
data type, then multiplied by `up` (rounded again).

silu_and_mul_int8: the same values, quantized per token for a W8A8 down projection in the same
launch (q int8 and scale float32 equal int8_quant(silu_and_mul(x)) bit for bit); the d-wide
activation row is never written in the data type and read back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton
from mllmd_kernels.int8_quant import ONE_PASS_MAX_K, _quant_row, int8_quant, int8_quant_ref, int8_scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [..., 2d] -> silu(x[..., :d]) * x[..., d:]  [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: x [R, 2d] -> per-token int8 (q [R, d], scale float32 [R, 1]) of silu_and_mul(x)."""
    return int8_quant_ref(silu_and_mul_ref(x))


@triton.jit
def _silu_mul(g, u, DTYPE: tl.constexpr):
    """silu(g) * u from fp32 loads, each product rounded to DTYPE as torch does (returned in fp32)."""
    s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
    return (s * u).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_int8_kernel(
    x_ptr,  # [R, 2 * D]
    q_ptr,  # [R, D] int8
    s_ptr,  # [R] float32
    D,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,  # >= D: the whole row in registers
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = _silu_mul(g, u, x_ptr.dtype.element_ty)  # masked lanes: silu(0) * 0 = 0, no effect on max|y|
    scale = int8_scale(tl.max(tl.abs(y), axis=0))
    tl.store(q_ptr + row * stride_q + offs, _quant_row(y, scale), mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton silu(gate) * up for x [R, 2d], quantized per token: (q int8 [R, d], scale float32 [R, 1]).

    One launch for d <= ONE_PASS_MAX_K (the row in registers); wider rows take silu_and_mul then
    int8_quant (the same values)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, "silu_and_mul_int8 needs a [R, 2d] x"
    d = x.shape[1] // 2
    if d > ONE_PASS_MAX_K:
        return int8_quant(silu_and_mul(x))
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    q = torch.empty((rows, d), dtype=torch.int8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = next_pow2(max(d, 16))
    _silu_and_mul_int8_kernel[(rows,)](
        x, q, scale, d, x.stride(0), q.stride(0), BLOCK=block,
        num_warps=4 if block <= 2048 else (8 if block <= 8192 else 16), **pdl_args(x),
    )  # fmt: skip
    return q, scale


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [R, 2 * D]
    out_ptr,  # [R, D]
    D,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = _silu_mul(g, u, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton silu(gate) * up for x [..., 2d]; returns [..., d] in x's dtype."""
    d = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, 2 * d)
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = min(1024, next_pow2(d))
    _silu_and_mul_kernel[(rows, cdiv(d, block))](
        x2, o2, d, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl_args(x2),
    )
    return out
