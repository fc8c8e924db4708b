"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mllmd_kernels import sigmoid_gate, silu_and_mul
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [.., 2 * d] gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels(x):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, H * D] * sigmoid(gate), gate [T, H, D] (Qwen3.5's gated attention): on the fused route one
    Triton launch that reads a strided gate in place (torch's numbers); else torch on [T, H * D]."""
    if fused_kernels(out):
        return sigmoid_gate(out, gate)
    return out * torch.sigmoid(gate.reshape(out.shape))
