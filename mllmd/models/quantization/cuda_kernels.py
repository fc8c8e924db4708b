"""CudaW4A16Kernel: TritonW4A16Kernel with up to 32 rows (decode batches, short prefills) on the CUDA tensor-core kernel
`mllmd_kernels.w4a16_mma`, where it builds (nvcc found, sm80+, MLLMD_CUDA_KERNELS not 0).

The layer's tensors are the Triton kernel's (float32 scales and zero points G-major), with the packed
words re-laid once in the CUDA kernel's `tile_order` (its loads are then contiguous runs: 4% faster on
the H200); larger batches and prefill keep the Triton paths on the same memory, which read that order
(`mma_vec`; one row that the CUDA kernel cannot take runs the skinny tiling instead of the gemv). A layer whose
shape the CUDA kernel does not take (N % 16, K % 256, a group that is not 32 / 64 / a power-of-two
multiple of 128 columns, a row whose staged x would not fit the GPU's shared memory) runs every batch
on the Triton paths; so does an x whose rows do not start on 16 bytes.

For one bf16 row (batch-1 decode) its launch can also apply (apply_fused) the RMSNorm before a layer
(the input_layernorm into qkv, the post-attention norm into gate/up) and silu(gate) * up after a
gate/up layer; the model then launches no rmsnorm or silu_and_mul kernel there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from mllmd_kernels import w4a16_mma as mma
from mllmd_kernels.rmsnorm import NormInput
from torch import nn

from mllmd.models.quantization.config import LinearScheme
from mllmd.models.quantization.kernels import register_kernel
from mllmd.models.quantization.triton_kernels import TritonW4A16Kernel, _rows

if TYPE_CHECKING:
    from mllmd.models.layers.linear import Linear


class CudaW4A16Kernel(TritonW4A16Kernel):
    """W4A16 on CUDA: up to 32 rows on the mma.sync kernel (w4a16_mma), the rest as TritonW4A16Kernel."""

    @classmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        why = super().can_implement(scheme, device)
        return why if why is not None else mma.unavailable_reason(device)  # builds the library once

    def process_weights(self, layer: Linear) -> None:
        super().process_weights(layer)
        n, k = layer.weight_packed.shape[0], layer.in_features
        group = k // layer.weight_scale.shape[1]
        device = layer.weight_packed.device
        self.mma_ok = mma.supports(1, n, k, group, layer.params_dtype) and mma.fits(1, k, group, layer.params_dtype, device)
        if self.mma_ok:  # the words as the CUDA kernel reads them; the Triton paths follow (mma_vec)
            layout = mma.mma_layout(k, group)
            assert layout is not None  # supports() checked it
            self.mma_vec = layout[0]
            layer.weight_packed = nn.Parameter(mma.tile_order(layer.weight_packed.data, self.mma_vec), requires_grad=False)
        self.fuses_norm = self.mma_ok and layer.params_dtype == torch.bfloat16  # the offset form stages x
        self.fuses_silu_mul = self.fuses_norm and n % 32 == 0

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x in the layer's dtype: so is its bias (Linear makes it so), which the kernel adds as it is
        x2 = _rows(x)
        rows = x2.shape[0]
        if self.mma_ok and 0 < rows <= mma.MAX_ROWS and x2.dtype == layer.params_dtype and mma.aligned(x2):
            zero_point = getattr(layer, "weight_zero_point", None)
            out = mma.w4a16_mma(x2, layer.weight_packed, layer.weight_scale, zero_point, bias)
            return out.reshape(*x.shape[:-1], layer.weight_packed.shape[0])
        return super().apply(layer, x, bias)

    def fusable(self, layer: Linear, x: torch.Tensor, norm: NormInput | None, silu: bool) -> bool:
        x2 = x.reshape(-1, x.shape[-1])
        if not (self.fuses_norm and x2.shape[0] == 1 and x2.dtype == layer.params_dtype and x2.stride(-1) == 1
                and mma.aligned(x2)):  # fmt: skip
            return False
        if silu and not self.fuses_silu_mul:
            return False
        return norm is None or mma.norm_fusable(x2, norm.weight, norm.residual)

    def apply_fused(
        self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None, norm: NormInput | None, silu: bool
    ) -> torch.Tensor | None:
        if not self.fusable(layer, x, norm, silu):
            return None
        x2 = _rows(x)
        zero_point = getattr(layer, "weight_zero_point", None)
        out = mma.w4a16_mma(x2, layer.weight_packed, layer.weight_scale, zero_point, bias, norm=norm, silu=silu)
        if norm is not None and norm.residual is None:
            norm.residual_out = x  # the first layer: the norm's input is the next residual
        return out.reshape(*x.shape[:-1], out.shape[-1])


register_kernel(CudaW4A16Kernel)
