"""rmsnorm_zero_centred: Qwen3.5's RMSNorm, whose weight is stored as an offset from 1 (Qwen3_5RMSNorm),
with an optional fused residual add.

Numerics as transformers' module, which differ from `rmsnorm`'s (Qwen3) in where they round: with a
residual, s = x + residual rounded to x's dtype (also returned as the new residual); then
out = float32(s) * rsqrt(mean(float32(s)^2) + eps) * (1 + float32(weight)), rounded once to x's
dtype (rmsnorm rounds the normed row before the weight multiply). One program per row.
"""

from __future__ import annotations

import torch

from mllmd_kernels._triton import next_pow2, pdl_args, pdl_sync, tl, triton


def rmsnorm_zero_centred_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H], the offset from 1
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: Qwen3_5RMSNorm(x), or (Qwen3_5RMSNorm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)
    return out if residual is None else (out, x)


@triton.jit
def _rmsnorm_zero_centred_kernel(
    x_ptr,  # [R, H]
    res_ptr,  # [R, H] (HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [R, H]
    res_out_ptr,  # [R, H] (HAS_RESIDUAL)
    H,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # rounded like x + residual
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (y * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [R, H] with a unit last stride (copies only if that is impossible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def rmsnorm_zero_centred(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton Qwen3.5 RMSNorm; with `residual` returns (norm(x + residual), x + residual) like the
    reference. `out` / `residual_out` may alias `x` / `residual` (each row is read before it is written)."""
    h = x.shape[-1]
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    x2, o2 = _rows(x), out.view(-1, h)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        r2, ro2 = _rows(residual), residual_out.view(-1, h)
    else:
        r2 = ro2 = x2
    if x2.shape[0]:
        block = next_pow2(h)
        _rmsnorm_zero_centred_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, ro2, h, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block,
            num_warps=1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16,
            **pdl_args(x2),
        )  # fmt: skip
    return out if residual is None else (out, residual_out)
