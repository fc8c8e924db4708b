"""Torch references for the quantized linear layers (run on CPU; a GPU kernel must match them).

Conventions are compressed-tensors' own, so that our outputs equal its fake-quantized model:
  * per-token int8 activations: scale = max|x| / 127.5 (the int8 range 255 / 2), a zero scale
    becomes float32 eps; q = round_half_even(clamp(x / scale, -128, 127));
  * int4 packing: eight 4-bit values per int32, value i of a word in bits [4i, 4i + 4), each
    stored as q + 8 (so -8..7 becomes 0..15); weights are packed along the input dim, zero points
    along the output dim;
  * dequantization: w = (q - zero_point) * scale, one scale per (output row, group of columns).
"""

from __future__ import annotations

import torch
from mllmd_kernels.w4a16_dequant import dequantize_int4_ref, pack_int4_ref, unpack_int4_ref

_INT8_RANGE_HALF = 127.5  # (127 - (-128)) / 2
_FP32_EPS = torch.finfo(torch.float32).eps
_int_mm_works: dict[str, bool] = {}


def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, 1]) with x ~= q * scale, symmetric per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its rounded reciprocal.
    scale = amax / torch.full_like(amax, _INT8_RANGE_HALF)
    scale = torch.where(scale == 0, torch.full_like(scale, _FP32_EPS), scale)
    q = torch.clamp(xf / scale, -128.0, 127.0).round_().to(torch.int8)
    return q, scale


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


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a int8 [M, K] @ b int8 [N, K]^T -> int32 [M, N], exactly.

    torch._int_mm where the device has it (CUDA only for M > 16 and K, N multiples of 8); else a
    float32 matmul of the integer values, exact while every |sum| < 2**24 (e.g. K <= 1024 at full
    range) and within float32 rounding beyond.
    """
    m, k = a.shape
    n = b.shape[0]
    if m == 0:
        return torch.zeros(0, n, dtype=torch.int32, device=a.device)
    shapes_ok = a.device.type != "cuda" or (m > 16 and k % 8 == 0 and n % 8 == 0)
    if shapes_ok and int_mm_available(a.device):
        return torch._int_mm(a, b.t())
    return torch.matmul(a.float(), b.float().t()).round_().to(torch.int32)


def int8_scaled_mm(
    a: torch.Tensor,  # [M, K] int8 activations
    b: torch.Tensor,  # [N, K] int8 weights
    a_scale: torch.Tensor,  # [M, 1] float32
    b_scale: torch.Tensor,  # [N, 1] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(a @ b^T) * a_scale * b_scale^T (+ bias) -> [M, N] out_dtype; int32 accumulation, float32 scaling."""
    acc = int8_mm(a, b).float()  # [M, N]
    out = acc * a_scale * b_scale.view(1, -1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 linear: x [..., K] (float) with weight int8 [N, K], weight_scale [N, 1] -> [..., N] x.dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = per_token_quant_int8(x2)
    out = int8_scaled_mm(q, weight, s, weight_scale, x.dtype, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# The int4 packing (unpack / pack / dequantize) is defined once, beside the GPU kernel that reads it.
unpack_int4 = unpack_int4_ref
pack_int4 = pack_int4_ref
dequantize_int4 = dequantize_int4_ref
