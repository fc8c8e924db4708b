"""silu_and_mul: silu(gate) * up over a fused [..., 2 * d] gate/up projection output.

Numerics as mllmd/models/layers/activation.py in torch: silu computed in fp32 and rounded to the
data type, then multiplied by `up` (rounded again).

silu_and_mul_int8: the same values, quantized per token for a W8A8 down projection in the same
launch (q int8 and scale float32 equal int8_quant(silu_and_mul(x)) bit for bit); the d-wide
activation row is never written in the data type and read back.

sigmoid_gate: x * sigmoid(gate), the gated attention output of Qwen3.5 (the gate a strided per-head
view of the qkv projection output); sigmoid rounded to the data type before the multiply, as torch
rounds it, and computed as torch's CUDA kernel does (1 / (1 + expf(-g)), expf from CUDA's math
library and a correctly rounded division), so that the results are torch's bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mllmd_kernels._triton import cdiv, interpreting, libdevice, next_pow2, pdl_args, pdl_sync, tl, triton
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


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Torch reference: x [T, H * D] * sigmoid(gate [T, H, D]) -> [T, H * D]."""
    return x * torch.sigmoid(gate.reshape(x.shape))


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr,  # [T, H * D]
    gate_ptr,  # [T, H, D] (any token and head strides)
    out_ptr,  # [T, H * D]
    H,
    D,
    stride_x,
    stride_gt,
    stride_gh,
    stride_out,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISE_EXP: tl.constexpr,  # libdevice's expf (a GPU); the interpreter has only tl.exp (numpy's)
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (heads < H)[:, None] & (dims < D)[None, :]  # [BLOCK_H, BLOCK_D]
    cols = heads[:, None] * D + dims[None, :]
    g = tl.load(gate_ptr + t * stride_gt + heads[:, None] * stride_gh + dims[None, :], mask=mask, other=0.0)
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = g.to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)  # tl.exp on a GPU is ex2.approx: not torch's expf
    s = tl.math.div_rn(1.0, 1.0 + e).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch.sigmoid(gate)
    tl.store(out_ptr + t * stride_out + cols, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton x * sigmoid(gate) for x [T, H * D] (rows with a unit column stride) and gate [T, H, D]
    (a strided view is read in place) or [T, H * D]; returns [T, H * D] in x's dtype, `out` if given
    (may be x)."""
    if gate.dim() == 2:
        gate = gate.unsqueeze(1)
    t, h, d = gate.shape
    assert x.shape == (t, h * d) and x.stride(1) == 1 and gate.stride(2) == 1, "x [T, H * D], gate [T, H, D]"
    assert gate.dtype == x.dtype, "x and gate of one dtype"
    if out is None:
        out = torch.empty((t, h * d), dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    if t == 0:
        return out
    block_d = min(1024, next_pow2(d))
    block_h = min(next_pow2(h), max(1, 1024 // block_d))
    _sigmoid_gate_kernel[(t, cdiv(h, block_h), cdiv(d, block_d))](
        x, gate, out, h, d, x.stride(0), gate.stride(0), gate.stride(1), out.stride(0),
        BLOCK_H=block_h, BLOCK_D=block_d, PRECISE_EXP=not interpreting(),
        num_warps=4 if block_h * block_d >= 512 else 1, **pdl_args(x),
    )  # fmt: skip
    return out
