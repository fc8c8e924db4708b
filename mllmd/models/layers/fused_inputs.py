"""Inputs that carry the last step of the op before into the next layer's kernel launch.

Between the layers of a decoder the fusion plan (fusion.py) may hand a Linear, instead of a plain
tensor, one of these: rows already quantized for a W8A8 kernel, rows with their max|x| partials,
or rows whose RMSNorm the consuming kernel applies itself. Only the layers package makes and
takes them; model files see plain tensors.
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
    """Rows x [T, H] whose RMSNorm (with the residual add) has not run yet: the consuming kernel
    applies it in its own launch where it can, else `normed()` runs it apart. Either way x + residual
    (x itself without a residual) lands in `residual_out`, the decoder's next residual, which the
    norm allocated when it handed these rows on."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: Any  # an RMSNorm: .weight, .eps, and norm(x) / norm(x, residual) -> (normed, x + residual)
    residual_out: torch.Tensor

    def normed(self) -> torch.Tensor:
        """Run the norm on its own, writing x + residual into residual_out."""
        if self.residual is None:
            return self.norm(self.x)  # residual_out is x itself
        out, total = self.norm(self.x, self.residual)
        self.residual_out.copy_(total)
        return out
