"""rmsnorm: RMSNorm with an optional fused residual add, Hugging Face Qwen3 numerics.

Numerics (as mllmd/models/layers/norm.py): with a residual, s = x + residual rounded to x's dtype
(also returned as the new residual); then xf = float32(s); y = xf * rsqrt(mean(xf^2) + eps),
rounded to x's dtype, then multiplied by the weight (rounded to the output dtype).
One program per row; rows are the flattened leading dimensions (so q/k-norm over heads works too).

rmsnorm_int8: the same normed rows quantized per token for a W8A8 projection in the same launch
(q int8 and scale float32 equal int8_quant(rmsnorm(...)) bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mllmd_kernels._triton import next_pow2, pdl_args, pdl_sync, tl, triton
from mllmd_kernels.int8_quant import _quant_row, int8_quant_ref, int8_scale


@dataclass
class NormInput:
    """An RMSNorm (this module's numerics) that a GEMM kernel may apply to its input x in its own launch:
    norm(x + residual) with `residual`, whose sum x + residual the kernel then writes to `residual_out`
    (a tensor of its own: not x or residual; the kernel allocates it when None)."""

    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None = None  # x's shape
    residual_out: torch.Tensor | None = None  # x's shape, written


def rmsnorm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: norm(x), or (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(in_dtype)
    return out if residual is None else (out, x)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R, H]
    res_ptr,  # [R, H] (HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [R, H]
    res_out_ptr,  # [R, H] (HAS_RESIDUAL)
    scale_ptr,  # [R] float32 (QUANT; out_ptr is then the int8 [R, H])
    H,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded like torch's x + residual
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = x * tl.rsqrt(var + eps)
    # HF rounds to the (summed) input dtype before multiplying by the weight.
    if HAS_RESIDUAL:
        y = y.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if QUANT:  # the normed row in x's dtype (= the weight's), then per-token int8 as int8_quant does
        o = (w * y).to(x_ptr.dtype.element_ty).to(tl.float32)  # masked lanes: 0
        scale = int8_scale(tl.max(tl.abs(o), axis=0))
        tl.store(out_ptr + row * stride_out + offs, _quant_row(o, scale), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [R, H] with a unit last stride (copies only if that is impossible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def rmsnorm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm; with `residual` returns (norm(x + residual), x + residual) like rmsnorm_ref.

    `out` / `residual_out` may alias `x` / `residual` (each row is read before it is written).
    """
    h = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x2 = _rows(x)
    o2 = out.view(-1, h)
    rows = x2.shape[0]
    if residual is not None:
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        r2, ro2 = _rows(residual), residual_out.view(-1, h)
    else:
        r2 = ro2 = x2
    if rows == 0:
        return out if residual is None else (out, residual_out)
    _launch(x2, r2, weight, o2, ro2, x2, eps, residual is not None, False)
    return out if residual is None else (out, residual_out)


def _launch(
    x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, o2: torch.Tensor, ro2: torch.Tensor,
    scale: torch.Tensor, eps: float, has_residual: bool, quant: bool,
) -> None:
    """One program per row of x2; with `quant`, o2 is int8 and `scale` [R] float32 is written too."""
    h = x2.shape[1]
    block = next_pow2(h)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    if quant and x2.shape[0] == 1 and block == 4096:
        # One quantized row of 4,096 (batch-1 decode): with 8 warps Triton gives the int8 store 16
        # elements a thread and the residual store 8, so the residual goes through shared memory;
        # 16 warps avoid that conversion and are faster (NOTES.md).
        num_warps = 16
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, ro2, scale, h, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), eps,
        HAS_RESIDUAL=has_residual, QUANT=quant, BLOCK_H=block, num_warps=num_warps, **pdl_args(x2),
        # No mul + add contraction: where LLVM fused x * x into the sum of squares depended on the code
        # after it, one more way for rmsnorm_int8's rows to differ from rmsnorm's in the last bit (the
        # other: their layouts, see test_rmsnorm).
        enable_fp_fusion=False,
    )  # fmt: skip


def rmsnorm_int8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Torch reference: (q, scale) of int8_quant(norm(x)), or (q, scale, x + residual) with a residual."""
    normed = rmsnorm_ref(x, weight, eps, residual)
    if residual is None:
        return int8_quant_ref(normed.reshape(-1, x.shape[-1]))
    q, scale = int8_quant_ref(normed[0].reshape(-1, x.shape[-1]))
    return q, scale, normed[1]


def rmsnorm_int8(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], x's dtype
) -> tuple[torch.Tensor, ...]:
    """Triton RMSNorm (+ residual add) whose rows come out quantized per token for a W8A8 layer:
    (q int8 [T, H], scale float32 [T, 1]), plus x + residual with a residual; equal bit for bit to
    int8_quant of rmsnorm's output (the normed rows are never written in x's dtype)."""
    assert x.dim() == 2, "rmsnorm_int8 needs [T, H] rows"
    assert weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype), (
        "rmsnorm_int8 needs x, weight and residual in one dtype"
    )
    t, h = x.shape
    x2 = _rows(x)
    q = torch.empty((t, h), dtype=torch.int8, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    residual_out = None
    r2 = ro2 = x2
    if residual is not None:
        residual_out = torch.empty_like(x2)
        r2, ro2 = _rows(residual), residual_out
    if t:
        _launch(x2, r2, weight, q, ro2, scale, eps, residual is not None, True)
    return (q, scale) if residual_out is None else (q, scale, residual_out)
