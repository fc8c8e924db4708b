"""RMSNorm with an optional fused residual add (numerics as in Hugging Face Qwen3).

What a norm hands the layer after it is set by the fusion plan (fusion.py): normed rows (the
default), rows quantized per token in the same launch for a W8A8 kernel, or, where the next
kernel applies the norm in its own launch, the rows still to norm (NormRows).
"""

from __future__ import annotations

from typing import Any

import torch
from mllmd_kernels import rmsnorm, rmsnorm_int8, rmsnorm_zero_centred, rmsnorm_zero_centred_ref
from mllmd_kernels.rmsnorm import NormInput
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.fused_inputs import Int8Rows, NormRows


def hand_on(norm: Any, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
    """The NormRows a norm hands the Linear that the fusion plan fused it into, where that layer's
    kernel takes them for this x (with the sum x + residual the launch will write); else None."""
    linear, silu = norm.fused_into
    if not linear.can_fuse_norm(x, NormInput(norm.weight, norm.eps, residual), silu):
        return None
    if residual is None:
        return NormRows(x, None, norm, x)
    total = torch.empty_like(x)  # the fused launch writes x + residual here
    return NormRows(x, residual, norm, total), total


class RMSNorm(nn.Module):
    prologue_kind = "rmsnorm"  # its numerics, for a kernel that applies it in its own launch

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        # Set by the fusion plan: quantize the output for a W8A8 kernel; or (linear, silu) whose launch
        # applies this norm itself where it can_fuse_norm (a tuple, so the layer is not a submodule).
        self.int8_output = False
        self.fused_into: tuple[Any, bool] | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). norm(x) is a
        tensor, or what the fusion plan has this norm hand on (Int8Rows, NormRows)."""
        if self.fused_into is not None and (pending := hand_on(self, x, residual)) is not None:
            return pending
        if self.int8_output:
            return self.forward_int8(x, residual)
        if fused_kernels(x):  # one Triton kernel: add, reduce, scale (same rounding as below)
            return rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_int8(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Int8Rows | tuple[Int8Rows, torch.Tensor]:
        """forward() for a W8A8 layer that comes next: the normed [T, H] rows quantized per token in
        the same Triton launch (equal to quantizing forward()'s Triton output)."""
        out = rmsnorm_int8(x, self.weight, self.eps, residual)
        if residual is None:
            return Int8Rows(out[0], out[1], x.dtype)
        return Int8Rows(out[0], out[1], x.dtype), out[2]


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: the weight stored as an offset from 1, applied as (1 + w) in float32 with one
    rounding (its own kernel: mllmd_kernels.rmsnorm_zero_centred). The fusion plan may fuse it into a
    dense projection's one-row GEMV, which applies these numerics (gemv_fused)."""

    prologue_kind = "rmsnorm_zero_centred"

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused_into: tuple[Any, bool] | None = None  # set by the fusion plan, as RMSNorm's

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). Where the
        fusion plan says so, the NormRows its Linear applies the norm to instead (RMSNorm.forward)."""
        if self.fused_into is not None and (pending := hand_on(self, x, residual)) is not None:
            return pending
        if fused_kernels(x):
            return rmsnorm_zero_centred(x, self.weight, self.eps, residual)
        return rmsnorm_zero_centred_ref(x, self.weight, self.eps, residual)
