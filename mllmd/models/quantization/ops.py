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

from mllmd_kernels.int8_gemm import int8_gemm_ref, int8_mm_ref, int_mm_available, w8a8_linear_ref
from mllmd_kernels.int8_quant import int8_quant_ref
from mllmd_kernels.w4a16_dequant import dequantize_int4_ref, pack_int4_ref, unpack_int4_ref

# Each reference is defined once, beside the GPU kernel that must match it (mllmd_kernels).
per_token_quant_int8 = int8_quant_ref
int8_mm = int8_mm_ref
int8_scaled_mm = int8_gemm_ref
unpack_int4 = unpack_int4_ref
pack_int4 = pack_int4_ref
dequantize_int4 = dequantize_int4_ref

__all__ = [
    "dequantize_int4",
    "int8_mm",
    "int8_scaled_mm",
    "int_mm_available",
    "pack_int4",
    "per_token_quant_int8",
    "unpack_int4",
    "w8a8_linear_ref",
]
