"""Inputs that carry the last step of the op before into the next layer's kernel launch.

Between the layers of a decoder the fusion plan (fusion.py) may have an op hand the next Linear,
instead of a plain tensor, one of these: rows already quantized for a W8A8 kernel, rows with their
max|x| partials, or rows whose RMSNorm the consuming kernel applies itself. Only the layers package
makes and takes them; model files pass them on without looking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Int8Rows:
    """Activations already quantized per token for a W8A8 layer (by the norm or activation kernel
    before it): q int8 [T, K], scale float32 [T, 1], and the dtype the layer's output takes."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


@dataclass
class RowsWithAmax:
    """Activations x [T, K] not yet quantized, with float32 partials whose max is max|x| (written by
    the kernel that produced x): a W8A8 layer that quantizes x in its own launch takes the scale
    from them instead of reading x an extra time."""

    x: torch.Tensor
    amax_parts: torch.Tensor


@dataclass
class NormRows:
    """Rows x [T, H] whose RMSNorm (with the residual add) the consuming kernel applies in its own
    launch (the norm hands these on only where `Linear.can_fuse_norm` said it will). The launch
    writes x + residual into `residual_out`, the decoder's next residual, which the norm allocated
    when it handed these rows on (x itself without a residual)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: Any  # an RMSNorm: .weight, .eps
    residual_out: torch.Tensor


@dataclass
class SiluRows:
    """Gate/up rows h [T, 2K] whose silu(gate) * up the consuming kernel applies to its input in its own
    launch (the down projection's one-row GEMV), instead of a SiLU-and-mul launch between them."""

    h: torch.Tensor


@dataclass
class GatedNormRows:
    """Qwen3.5's DeltaNet output rows x [T, K] = heads of `group`, whose gated RMSNorm (weight [group],
    gate z [T, K]) the consuming kernel applies in its own launch (the out projection's one-row GEMV)."""

    x: torch.Tensor
    z: torch.Tensor
    weight: torch.Tensor
    eps: float
    group: int
