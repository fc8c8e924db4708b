"""Linear layers that allocate without initialising and load (possibly fused) checkpoint shards.

A layer built with a quantization scheme stores the checkpoint's quantized tensors instead of a
dense `weight` and computes through its QuantMethod (mllmd.models.quantization), whose kernel is
chosen per device once the weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from mllmd_kernels import gemv
from mllmd_kernels.rmsnorm import NormInput
from torch import nn

from mllmd.models.layers.activation import SiluAndMul
from mllmd.models.layers.dispatch import use_gemv
from mllmd.models.quantization import LinearScheme, QuantMethod, create_quant_method


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


_SILU_AND_MUL = SiluAndMul()


@dataclass
class NormRows:
    """Rows x [T, H] whose RMSNorm (with the residual add) has not run yet: a layer whose kernel applies
    it in its own launch (`Linear.fuses_norm`) does so, others run `norm` first. Once the layer has
    run, `residual_out` holds x + residual (x itself without a residual): the decoder's next residual."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: Any  # an RMSNorm: norm(x) or norm(x, residual) -> (normed, x + residual); .weight, .eps
    residual_out: torch.Tensor | None = None

    def normed(self) -> torch.Tensor:
        """Run the norm on its own (sets residual_out)."""
        if self.residual is None:
            self.residual_out = self.x
            return self.norm(self.x)
        out, self.residual_out = self.norm(self.x, self.residual)
        return out


class Linear(nn.Module):
    """y = x W^T (+ b); weights are filled by the loader, never randomly initialised."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant: LinearScheme | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.params_dtype = dtype or torch.get_default_dtype()
        self.quant_method: QuantMethod | None = create_quant_method(quant) if quant is not None else None
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        else:
            self.quant_method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor | Int8Rows | RowsWithAmax | NormRows) -> torch.Tensor:
        if isinstance(x, NormRows):  # the norm in this layer's launch where its kernel can, else apart
            out = self._apply_fused(x, silu=False)
            if out is not None:
                return out
            x = x.normed()
        if isinstance(x, Int8Rows):  # quantized by the op before (only when takes_int8_input)
            if self.quant_method is None:
                raise RuntimeError("int8 rows given to an unquantized layer")
            return self.quant_method.apply_int8(self, x.q, x.scale, x.dtype, self.bias)
        if isinstance(x, RowsWithAmax):
            if self.quant_method is not None:
                return self.quant_method.apply_with_amax(self, x.x, x.amax_parts, self.bias)
            x = x.x
        if self.quant_method is None:
            if self.bias is None and use_gemv(x):
                return gemv(x, self.weight)  # decode: split-K GEMV reads W near copy bandwidth
            return F.linear(x, self.weight, self.bias)
        return self.quant_method.apply(self, x, self.bias)

    @property
    def takes_int8_input(self) -> bool:
        """The layer's kernel accepts per-token int8 activations (W8A8 on the GPU), so the op before
        it may quantize them in its own launch and pass `Int8Rows` to forward()."""
        return self.quant_method is not None and self.quant_method.takes_int8_input

    def _apply_fused(self, x: torch.Tensor | NormRows, silu: bool) -> torch.Tensor | None:
        """The kernel's launch with the norm of NormRows before it (setting its residual_out) and / or
        silu(gate) * up after it; None where the kernel cannot for this x."""
        if self.quant_method is None:
            return None
        if not isinstance(x, NormRows):
            return self.quant_method.apply_fused(self, x, self.bias, None, silu)
        if not self.quant_method.fuses_norm:
            return None
        norm = NormInput(x.norm.weight, x.norm.eps, x.residual)
        out = self.quant_method.apply_fused(self, x.x, self.bias, norm, silu)
        if out is not None:
            x.residual_out = norm.residual_out
        return out

    @property
    def fuses_norm(self) -> bool:
        """The layer's kernel can apply the RMSNorm before it in its own launch (for some inputs: one
        bf16 row on the W4A16 CUDA kernel), so the decoder may pass `NormRows` to forward()."""
        return self.quant_method is not None and self.quant_method.fuses_norm

    @property
    def takes_amax(self) -> bool:
        """The layer's kernel quantizes its input itself and can take the scale from max|x| partials
        the op before wrote (`RowsWithAmax`), so that op may write them."""
        return self.quant_method is not None and self.quant_method.takes_amax

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        """(first output row, row count) of a checkpoint shard; the whole layer for None."""
        if shard is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard!r}")
        return 0, self.out_features

    def load_weight(self, name: str, loaded: torch.Tensor, shard: str | None = None) -> bool:
        """Copy checkpoint tensor `name` (weight, bias, weight_scale, ...) into its rows of the
        parameter; False for a tensor that is only checked (e.g. W4A16 `weight_shape`)."""
        offset, size = self.shard_rows(shard)
        if self.quant_method is not None and name != "bias":
            converted = self.quant_method.loaded_tensor(self, name, loaded, size)
            if converted is None:
                return False
            loaded = converted
        target = getattr(self, name, None) if name in self._parameters else None
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} for this layer (quantization: {self.quant_label})")
        if loaded.shape[0] != size or loaded.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"{name} has shape {tuple(loaded.shape)}, expected {(size, *target.shape[1:])}"
                + (f" for shard {shard!r}" if shard is not None else "")
            )
        if not target.dtype.is_floating_point and loaded.dtype.is_floating_point:
            # Packed or quantized integers stored as floats would be rounded into other numbers.
            raise ValueError(f"{name} is {loaded.dtype}, expected integers ({target.dtype})")
        target.data[offset : offset + size].copy_(loaded)
        return True

    @property
    def quant_label(self) -> str:
        return self.quant_method.scheme.describe() if self.quant_method is not None else "none"

    def process_weights_after_loading(self) -> None:
        """Let the quantized layer's kernel prepare its weights (no-op when unquantized)."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (QKV, gate/up)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant: LinearScheme | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, quant)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        if shard not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard!r} (expected one of {', '.join(self.shard_offsets)})")
        return self.shard_offsets[shard]

    @property
    def fuses_silu_mul(self) -> bool:
        """The layer's kernel can apply silu(gate) * up in its own launch (for some inputs: one bf16
        row on the W4A16 CUDA kernel), so the MLP may call forward_silu_mul()."""
        return self.quant_method is not None and self.quant_method.fuses_silu_mul

    def forward_silu_mul(self, x: torch.Tensor | Int8Rows | NormRows) -> torch.Tensor | RowsWithAmax:
        """silu(first shard) * second shard of this gate/up layer's output [T, N / 2], in the kernel's
        own epilogue where it has one (int8 rows: only when takes_int8_input, with the max|out| partials
        where that epilogue writes them; else where fuses_silu_mul, and the norm of `NormRows` too),
        otherwise by a separate activation."""
        sizes = [size for _, size in self.shard_offsets.values()]
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            raise RuntimeError(f"silu_and_mul needs two equal shards, not {sizes}")
        if isinstance(x, Int8Rows):
            if self.quant_method is None:
                raise RuntimeError("int8 rows given to an unquantized layer")
            out, amax_parts = self.quant_method.apply_int8_silu_mul(self, x.q, x.scale, x.dtype, self.bias)
            return out if amax_parts is None else RowsWithAmax(out, amax_parts)
        if self.quant_method is not None and self.quant_method.fuses_silu_mul:
            out = self._apply_fused(x, silu=True)
            if out is None and isinstance(x, NormRows):  # the norm apart, silu in the launch where it can
                x = x.normed()
                out = self._apply_fused(x, silu=True)
            if out is not None:
                return out
        if isinstance(x, NormRows):
            x = x.normed()
        return _SILU_AND_MUL(self(x))

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> bool:
        """Copy one checkpoint tensor (e.g. k_proj.weight) into its slice of the fused parameter."""
        return self.load_weight(param_name, loaded, shard)
