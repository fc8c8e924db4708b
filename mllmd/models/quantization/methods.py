"""Quant methods: what a quantized Linear stores, how checkpoint shards fill it, and which kernel runs it.

Every stored tensor has the output dim first, so the shards of a fused layer (QKV, gate/up) fill
row ranges of it and keep their own scales: per-channel and per-group scales, like the int8 or
packed int4 rows, simply concatenate along the output dim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from mllmd.models.quantization import ops
from mllmd.models.quantization.config import W4A16, W8A8, LinearScheme
from mllmd.models.quantization.kernels import QuantLinearKernel, select_kernel

if TYPE_CHECKING:
    from mllmd.models.layers.linear import Linear


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantMethod(ABC):
    """Stores one Linear's quantized weights and runs them through the kernel chosen for its device."""

    def __init__(self, scheme: LinearScheme) -> None:
        self.scheme = scheme
        self.kernel: QuantLinearKernel | None = None

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the (empty) parameters the checkpoint fills."""

    def loaded_tensor(self, layer: Linear, name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
        """What parameter `name` stores for a checkpoint tensor covering `rows` output rows
        (None: a tensor that is only checked, such as `weight_shape`)."""
        return tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        device = layer.weight_scale.device
        self.kernel = select_kernel(self.scheme, device)
        self.kernel.process_weights(layer)

    def _loaded_kernel(self) -> QuantLinearKernel:
        if self.kernel is None:
            raise RuntimeError("quantized layer used before its weights were loaded")
        return self.kernel

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._loaded_kernel().apply(layer, x, bias)


class W8A8Int8Method(QuantMethod):
    """`weight` int8 [N, K] and `weight_scale` float32 [N, 1] (static, symmetric, per channel)."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = _param(layer.out_features, layer.in_features, dtype=torch.int8)
        layer.weight_scale = _param(layer.out_features, 1, dtype=torch.float32)


class W4A16Method(QuantMethod):
    """`weight_packed` int32 [N, ceil(K / 8)], `weight_scale` float32 [N, G] and, if asymmetric,
    `weight_zero_point` int8 [N, G] (unpacked at load: the checkpoint packs it along N)."""

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        groups = self.scheme.num_groups(k)
        layer.weight_packed = _param(n, -(-k // 8), dtype=torch.int32)
        layer.weight_scale = _param(n, groups, dtype=torch.float32)
        if not self.scheme.symmetric:
            layer.weight_zero_point = _param(n, groups, dtype=torch.int8)

    def loaded_tensor(self, layer: Linear, name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor | None:
        if name == "weight_shape":
            if [int(v) for v in tensor.tolist()] != [rows, layer.in_features]:
                raise ValueError(f"weight_shape is {tensor.tolist()}, expected {[rows, layer.in_features]}")
            return None
        if name == "weight_zero_point":
            if self.scheme.symmetric:
                raise ValueError("weight_zero_point given for a symmetric scheme")
            return ops.unpack_int4(tensor.t().contiguous(), rows).t()  # [rows, G]
        return tensor


def create_quant_method(scheme: LinearScheme) -> QuantMethod:
    if scheme.method == W8A8:
        return W8A8Int8Method(scheme)
    if scheme.method == W4A16:
        return W4A16Method(scheme)
    raise ValueError(f"no quant method for {scheme.method!r}")
