"""Triton GEMM kernels for the quantized Linear layers on CUDA (mllmd_kernels; torch references in `kernels`).

* TritonW8A8Kernel (`w8a8_linear`): per-token int8 activation quantization (`int8_quant`,
  compressed-tensors' rounding bit for bit), then int8 x int8 -> int32 on the tensor cores with the
  per-token and per-channel scales (and bias) in the epilogue (`int8_gemm`); a single row (decode at
  batch 1) takes one integer-gemv launch with the quantization fused in (`w8a8_gemv`, the same
  result bit for bit). The int8 weight [N, K] is used as stored (K-major is what int8 MMA wants).
  It also takes activations already quantized by the op before it (`apply_int8`): in Qwen3
  `rmsnorm_int8` feeds the qkv and gate/up projections and `silu_and_mul_int8` the down projection
  (so only o takes the fused one-row gemv at batch 1). For one row the gate/up gemv also applies
  silu(gate) * up in its epilogue (`apply_int8_silu_mul`), and down quantizes that row itself,
  its scale from the max|output| partials the gate/up gemv wrote (`apply_with_amax`); o takes its
  scale likewise from the decode attention's partials.
* TritonW4A16Kernel: int4 unpacked and dequantized inside the GEMM (`w4a16_gemm`), a split-K decode
  path for small batches (each layer keeps its own split-K counters, so the last program of a tile
  adds the partials: no reduce launch) and a tiled prefill path. The packed weight is used as stored; the scales
  (and zero points) are made column-major once at load (same shape), so a K step reads the scales of
  a block of rows contiguously; the scales stay float32 even where the checkpoint stored bf16 (the
  one-row gemv waits on 2-byte scale loads every K step: see mllmd_kernels.SCALE_DTYPES).

Both are registered ahead of the torch references (mllmd.models.quantization imports this module)
and accept only CUDA devices with Triton, so CPU runs keep the references. `apply` launches kernels
whose shapes depend only on x.shape: no host synchronisation, CUDA-graph capturable. The layer's
parameters stay the checkpoint's quantized tensors (W4A16 scales as float32, however stored), so
weight_bytes counts what is read per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from mllmd_kernels import (
    DEQUANT_F32,
    dequant_mode,
    int8_gemm,
    int8_gemm_silu_mul_amax,
    prefers_dequant,
    scales_exact_in,
    splitk_counter_len,
    triton_available,
    w4a16_dequantize,
    w4a16_gemm,
    w8a8_linear,
)
from torch import nn

from mllmd.models.quantization.config import W4A16, W8A8, LinearScheme
from mllmd.models.quantization.kernels import QuantLinearKernel, register_kernel

if TYPE_CHECKING:
    from mllmd.models.layers.linear import Linear

def _triton_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device (got {device.type})"
    if not triton_available():
        return "Triton is not installed"
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [T, K] with a unit last stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _column_major(t: torch.Tensor) -> nn.Parameter:
    """The same [N, G] values stored G-major (strides (1, N)): a K step reads N-contiguous scales."""
    return nn.Parameter(t.detach().t().contiguous().t(), requires_grad=False)


class TritonW8A8Kernel(QuantLinearKernel):
    """W8A8 on CUDA: Triton per-token int8 quantization + int8 tensor-core GEMM with fused scaling
    (one row: one gemv launch with the quantization fused in)."""

    @classmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        if scheme.method != W8A8:
            return f"only {W8A8}"
        return _triton_cuda(device)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = w8a8_linear(_rows(x), layer.weight, layer.weight_scale, bias)
        return out.reshape(*x.shape[:-1], layer.weight.shape[0])

    takes_int8_input = True
    # One row: the gate/up gemv and the decode attention write max|output| partials from which the
    # down and o gemvs take their scales (they do not read their input row twice)
    takes_amax = True

    def apply_int8(
        self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return int8_gemm(q, layer.weight, scale, layer.weight_scale, out_dtype, bias)

    def apply_int8_silu_mul(
        self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # One row: one gemv launch whose epilogue applies the activation (no silu_and_mul launch) and
        # writes max|output| partials, from which the down projection's gemv takes its scale.
        return int8_gemm_silu_mul_amax(q, layer.weight, scale, layer.weight_scale, out_dtype, bias, amax=True)

    def apply_with_amax(
        self, layer: Linear, x: torch.Tensor, amax_parts: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out = w8a8_linear(_rows(x), layer.weight, layer.weight_scale, bias, amax_parts=amax_parts)
        return out.reshape(*x.shape[:-1], layer.weight.shape[0])


class TritonW4A16Kernel(QuantLinearKernel):
    """W4A16 on CUDA: in-kernel int4 unpacking and group dequantization (decode and prefill tilings)."""

    mma_vec = 0  # the layer's words in w4a16_mma.tile_order (CudaW4A16Kernel), else 0: row-major
    exact_scales = False  # the scales are values of the layer's dtype (set by process_weights)

    @classmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        if scheme.method != W4A16:
            return f"only {W4A16}"
        if scheme.group_size is not None and scheme.group_size % 16:
            return f"group size {scheme.group_size} is not a multiple of 16"
        return _triton_cuda(device)

    def process_weights(self, layer: Linear) -> None:
        # float32 (as loaded, a bf16 checkpoint's scales widened): bf16 scales made the one-row gemv
        # 21% slower on the H200 (see SCALE_DTYPES), for 0.6% of the bf16 model's bytes
        layer.weight_scale = _column_major(layer.weight_scale.data.float())
        # Scales that are values of the layer's dtype (a 16-bit checkpoint's are) let the tensor-core
        # tilings dequantize in that dtype: the same weights in fewer instructions.
        self.exact_scales = scales_exact_in(layer.weight_scale, layer.params_dtype)
        if getattr(layer, "weight_zero_point", None) is not None:
            layer.weight_zero_point = _column_major(layer.weight_zero_point)
        # This layer's split-K arrival counters (decode): its launches reduce their own partials.
        n = layer.weight_packed.shape[0]
        counters = torch.zeros(splitk_counter_len(n), dtype=torch.int32, device=layer.weight_packed.device)
        layer.register_buffer("splitk_counters", counters, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = _rows(x)
        zero_point = getattr(layer, "weight_zero_point", None)
        group = layer.in_features // layer.weight_scale.shape[1]
        exact = self.exact_scales and x2.dtype == layer.params_dtype
        planes = dequant_mode(x2, exact) != DEQUANT_F32
        if prefers_dequant(x2, layer.weight_packed.shape[0], group, planes):  # prefill: dequantize once, then cuBLAS
            w = w4a16_dequantize(
                layer.weight_packed, layer.weight_scale, zero_point, layer.in_features, x2.dtype, mma_vec=self.mma_vec
            )
            out = F.linear(x2, w, bias)
            return out.reshape(*x.shape[:-1], layer.weight_packed.shape[0])
        out = w4a16_gemm(
            x2, layer.weight_packed, layer.weight_scale, zero_point, bias, splitk_counters=layer.splitk_counters,
            mma_vec=self.mma_vec, exact_scales=exact,
        )
        return out.reshape(*x.shape[:-1], layer.weight_packed.shape[0])


register_kernel(TritonW8A8Kernel)
register_kernel(TritonW4A16Kernel)
