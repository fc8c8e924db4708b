"""Quantized GEMM kernels behind the Linear layer, chosen per device.

A kernel turns the tensors a QuantMethod loaded onto a layer into y = x W^T (+ b). The layer's
tensors (the checkpoint's, as loaded; all nn.Parameters, so ModelInfo.weight_bytes counts them):
  * w8a8: `weight` int8 [N, K]; `weight_scale` float32 [N, 1]. Activations are quantized per
    token as `ops.per_token_quant_int8` does (compressed-tensors' rounding), accumulated in int32,
    then scaled by `x_scale * weight_scale`.
  * w4a16: `weight_packed` int32 [N, ceil(K / 8)] (`ops.unpack_int4` layout); `weight_scale`
    float32 [N, G]; `weight_zero_point` int8 [N, G] in [-8, 7], unpacked (asymmetric schemes
    only); `scheme.group_width(K)` columns per scale; w = (q - zero_point) * scale.
A kernel may re-lay these out once in `process_weights` (replace the parameters; keep anything
derived that is not what the device reads per step as a non-persistent buffer). `select_kernel`
takes the first registered kernel whose `can_implement` accepts the scheme and device; the torch
references come last and accept everything, so a GPU kernel is added with `register_kernel`
(or by listing it ahead of them in `_KERNELS`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from mllmd_kernels.rmsnorm import NormInput

from mllmd.models.quantization import ops
from mllmd.models.quantization.config import W4A16, W8A8, LinearScheme

if TYPE_CHECKING:
    from mllmd.models.layers.linear import Linear

logger = logging.getLogger(__name__)


class QuantLinearKernel(ABC):
    """One GEMM implementation for one or more schemes on some devices; one instance per layer."""

    def __init__(self, scheme: LinearScheme) -> None:
        self.scheme = scheme

    @classmethod
    @abstractmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        """None if this kernel runs `scheme` on `device`, else the reason it cannot."""

    def process_weights(self, layer: Linear) -> None:
        """One-time preparation after every shard of the layer is loaded (re-layout, dequantize)."""
        return None

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K] in the compute dtype -> [T, N] in the same dtype."""

    # Kernels that set this take activations the op before them quantized per token (apply_int8).
    takes_int8_input: bool = False
    # Kernels that set this take max|x| partials the op before wrote (apply_with_amax).
    takes_amax: bool = False

    def apply_int8(
        self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """q int8 [T, K] with its per-token scale float32 [T, 1] -> [T, N] out_dtype."""
        raise NotImplementedError(f"{type(self).__name__} takes no int8 activations")

    def apply_int8_silu_mul(
        self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As apply_int8 for a fused gate/up layer, then silu(gate) * up -> [T, N / 2] out_dtype; and,
        where the kernel has them, float32 partials whose max is max|output| (else None)."""
        raise NotImplementedError(f"{type(self).__name__} takes no int8 activations")

    def apply_with_amax(
        self, layer: Linear, x: torch.Tensor, amax_parts: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """apply() for an x whose max|x| partials the op before wrote (apply_int8_silu_mul's): a kernel
        that quantizes x itself may take its scale from them. By default: apply()."""
        return self.apply(layer, x, bias)

    # Kernels that set these (after process_weights) may fuse an RMSNorm before / silu(gate) * up
    # after the product into their launch (apply_fused), for some inputs.
    fuses_norm: bool = False
    fuses_silu_mul: bool = False

    def fusable(self, layer: Linear, x: torch.Tensor, norm: NormInput | None, silu: bool) -> bool:
        """Whether apply_fused runs this x (with this norm, and silu) in one launch."""
        return False

    def apply_fused(
        self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None, norm: NormInput | None, silu: bool
    ) -> torch.Tensor | None:
        """apply() with `norm` applied to x first (leaving x + residual in norm.residual_out) and / or
        (`silu`, a gate/up layer) silu(first half) * second half of the output, in one launch; None
        where this kernel cannot for this x (`fusable` says so beforehand)."""
        return None


class TorchW8A8Kernel(QuantLinearKernel):
    """Reference: per-token int8 activations, int8 x int8 -> int32 (torch._int_mm, or exact
    float64 sums where the device or shape does not allow it), scales applied after."""

    @classmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        return None if scheme.method == W8A8 else f"only {W8A8}"

    def process_weights(self, layer: Linear) -> None:
        ops.int_mm_available(layer.weight.device)  # probe now, not inside a step

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.w8a8_linear_ref(x, layer.weight, layer.weight_scale, bias)


class TorchW4A16Kernel(QuantLinearKernel):
    """Reference: dequantize once at load into the compute dtype (kept as the non-persistent
    buffer `weight_dequant`, beside the packed parameters), then a dense matmul."""

    @classmethod
    def can_implement(cls, scheme: LinearScheme, device: torch.device) -> str | None:
        return None if scheme.method == W4A16 else f"only {W4A16}"

    def process_weights(self, layer: Linear) -> None:
        zero_point = getattr(layer, "weight_zero_point", None)
        w = ops.dequantize_int4(layer.weight_packed, layer.weight_scale, zero_point, layer.in_features, layer.params_dtype)
        layer.register_buffer("weight_dequant", w, persistent=False)  # [N, K]

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight_dequant, bias)


# Preference order: the first kernel that can implement a scheme on a device wins.
_KERNELS: list[type[QuantLinearKernel]] = [TorchW8A8Kernel, TorchW4A16Kernel]
_announced: set[tuple[str, str, str]] = set()


def register_kernel(kernel: type[QuantLinearKernel]) -> type[QuantLinearKernel]:
    """Prefer `kernel` over those registered before it (usable as a class decorator)."""
    if kernel in _KERNELS:
        _KERNELS.remove(kernel)
    _KERNELS.insert(0, kernel)
    return kernel


def unregister_kernel(kernel: type[QuantLinearKernel]) -> None:
    if kernel in _KERNELS:
        _KERNELS.remove(kernel)


def select_kernel(scheme: LinearScheme, device: torch.device) -> QuantLinearKernel:
    """An instance of the preferred kernel for `scheme` on `device`."""
    reasons = []
    for kernel in _KERNELS:
        why = kernel.can_implement(scheme, device)
        if why is None:
            key = (kernel.__name__, scheme.method, device.type)
            if key not in _announced:
                _announced.add(key)
                logger.info("%s layers on %s use %s", scheme.method, device.type, kernel.__name__)
            return kernel(scheme)
        reasons.append(f"{kernel.__name__}: {why}")
    raise RuntimeError(f"no kernel runs {scheme.describe()} on {device}: {'; '.join(reasons)}")
