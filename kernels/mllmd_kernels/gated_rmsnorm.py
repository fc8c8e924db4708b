"""gated_rmsnorm: the GDN output norm, silu(z) * rmsnorm(x) * weight per head (Qwen3_5RMSNormGated).

Numerics as transformers' module ("norm before gate"): xf = float32(x); y = xf * rsqrt(mean(xf^2) + eps)
rounded to x's dtype; times the weight in their promoted dtype (rounded there: bf16 * bf16 stays
bf16); times silu(float32(z)) in float32; rounded to x's dtype.

Rows are the flattened leading dimensions ([T, H, D] -> T * H rows of D); BLOCK_R rows a program, so
that D = 128 rows still give each program some work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import cdiv, next_pow2, pdl_args, pdl_sync, tl, triton


def gated_rmsnorm_ref(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor,  # [..., D] the gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # x's shape and dtype
    """Torch reference: Qwen3_5RMSNormGated.forward."""
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(in_dtype)
    return (y * F.silu(z.to(torch.float32))).to(in_dtype)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr,  # [R, D]
    z_ptr,  # [R, D]
    w_ptr,  # [D]
    out_ptr,  # [R, D]
    R,
    D,
    stride_x,
    stride_z,
    stride_out,
    eps,
    ROUND_PRODUCT: tl.constexpr,  # weight * y is rounded to x's dtype (weight and x both 16-bit)
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (offs < D)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    if ROUND_PRODUCT:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    zf = tl.load(z_ptr + rows[:, None] * stride_z + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    out = y * (zf * tl.sigmoid(zf))
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [R, D] with a unit last stride (copies only if that is impossible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def gated_rmsnorm(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    out: torch.Tensor | None = None,  # x's shape and dtype; may alias x
) -> torch.Tensor:
    """Triton silu(z) * rmsnorm(x) * weight over the last dimension, equal to gated_rmsnorm_ref."""
    assert z.shape == x.shape and weight.shape == x.shape[-1:], "z must be x's shape, weight [D]"
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    x2, z2, o2 = _rows(x), _rows(z), out.view(-1, d)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block_d = next_pow2(d)
    block_r = max(1, min(16, 2048 // block_d))
    round_product = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    _gated_rmsnorm_kernel[(cdiv(rows, block_r),)](
        x2, z2, weight, o2, rows, d, x2.stride(0), z2.stride(0), o2.stride(0), eps,
        ROUND_PRODUCT=round_product, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4, **pdl_args(x2),
    )  # fmt: skip
    return out
