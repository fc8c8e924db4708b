"""RMSNorm with an optional fused residual add (numerics as in Hugging Face Qwen3)."""

from __future__ import annotations

import torch
from mllmd_kernels import rmsnorm, rmsnorm_int8
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.linear import Int8Rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
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
