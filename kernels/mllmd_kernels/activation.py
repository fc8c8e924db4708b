"""silu_and_mul: silu(gate) * up over a fused [..., 2 * d] gate/up projection output.

Numerics as mllmd/models/layers/activation.py in torch: silu computed in fp32 and rounded to the
data type, then multiplied by `up` (rounded again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import next_pow2, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [..., 2d] -> silu(x[..., :d]) * x[..., d:]  [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [R, 2 * D]
    out_ptr,  # [R, D]
    D,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


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
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2, o2, d, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out
