"""Linear layers that allocate without initialising and load (possibly fused) checkpoint shards.

A layer built with a quantization scheme stores the checkpoint's quantized tensors instead of a
dense `weight` and computes through its QuantMethod (mllmd.models.quantization), whose kernel is
chosen per device once the weights are loaded. Besides plain tensors a layer takes the inputs of
fused_inputs.py, which the fusion plan (fusion.py) has the op before it hand on only where the
layer's kernel takes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mllmd_kernels import gemv
from mllmd_kernels.gemv_fused import RowPrologue, fusable, gemv_fused
from mllmd_kernels.rmsnorm import NormInput
from torch import nn

from mllmd.models.layers.dispatch import use_gemv
from mllmd.models.layers.fused_inputs import GatedNormRows, Int8Rows, NormRows, RowsWithAmax, SiluRows
from mllmd.models.quantization import LinearScheme, QuantLinearKernel, QuantMethod, create_quant_method


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

    def forward(self, x: torch.Tensor | Int8Rows | RowsWithAmax | NormRows | SiluRows | GatedNormRows) -> torch.Tensor:
        if isinstance(x, NormRows):  # the norm in this layer's launch (the plan made sure it can)
            if self.quant_method is None:
                return gemv_fused(x.x, self.weight, norm_prologue(x))
            return self._apply_fused(x, silu=False)
        if isinstance(x, (SiluRows, GatedNormRows)):  # only ever handed to a dense one-row GEMV
            rows, prologue = row_prologue(x)
            return gemv_fused(rows, self.weight, prologue)
        if isinstance(x, Int8Rows):  # quantized by the op before (only where the kernel takes_int8_input)
            return self.kernel.apply_int8(self, x.q, x.scale, x.dtype, self.bias)
        if isinstance(x, RowsWithAmax):
            if self.quant_method is not None:
                return self.kernel.apply_with_amax(self, x.x, x.amax_parts, self.bias)
            x = x.x
        if self.quant_method is None:
            if self.bias is None and use_gemv(x):
                return gemv(x, self.weight)  # decode: split-K GEMV reads W near copy bandwidth
            return F.linear(x, self.weight, self.bias)
        return self.quant_method.apply(self, x, self.bias)

    @property
    def kernel(self) -> QuantLinearKernel:
        """The quantized kernel chosen for this layer's device (after loading); the fusion plan reads
        what it can take."""
        kernel = self.quant_method.kernel if self.quant_method is not None else None
        if kernel is None:
            raise RuntimeError("an unquantized or not yet loaded layer has no quantized kernel")
        return kernel

    def can_fuse_norm(self, x: torch.Tensor, norm: NormInput, silu: bool) -> bool:
        """Whether this layer's kernel applies `norm` to x in its own launch (and, with `silu`, a gate/up
        layer's silu(gate) * up too) for this x."""
        if self.quant_method is None:  # the dense one-row GEMV (norm weights are 16-bit like x)
            return not silu and self.takes_rows(x, RowPrologue("rmsnorm", norm.weight, norm.eps))
        kernel = self.quant_method.kernel
        return kernel is not None and kernel.fusable(self, x, norm, silu)

    def takes_rows(self, x: torch.Tensor, prologue: RowPrologue) -> bool:
        """Whether this dense layer's one-row GEMV (gemv_fused) applies `prologue` to x in its launch."""
        return self.quant_method is None and self.bias is None and use_gemv(x) and fusable(x, self.weight, prologue)

    def _apply_fused(self, x: torch.Tensor | NormRows, silu: bool) -> torch.Tensor:
        """The kernel's launch with the norm of NormRows before it and / or silu(gate) * up after it."""
        if isinstance(x, NormRows):
            norm = NormInput(x.norm.weight, x.norm.eps, x.residual, x.residual_out if x.residual is not None else None)
            out = self.kernel.apply_fused(self, x.x, self.bias, norm, silu)
        else:
            out = self.kernel.apply_fused(self, x, self.bias, None, silu)
        if out is None:
            raise RuntimeError("the fused launch was planned for an input its kernel does not take")
        return out

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
        check_tensor_dtype(name, loaded, target.dtype)
        target.data[offset : offset + size].copy_(loaded)
        return True

    @property
    def quant_label(self) -> str:
        return self.quant_method.scheme.describe() if self.quant_method is not None else "none"

    def process_weights_after_loading(self) -> None:
        """Let the quantized layer's kernel prepare its weights (no-op when unquantized)."""
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)


def check_tensor_dtype(name: str, loaded: torch.Tensor, target: torch.dtype) -> None:
    """A checkpoint tensor must be of the parameter's kind: copy_ converts any dtype into any other, so
    packed or quantized integers stored as floats would be rounded into other numbers, and integers
    or booleans in a float weight (a checkpoint whose header says I32 for it) loaded as garbage."""
    if target.is_floating_point != loaded.dtype.is_floating_point or (loaded.dtype == torch.bool) != (target == torch.bool):
        kind = "a floating-point tensor" if target.is_floating_point else "integers"
        raise ValueError(f"{name} is {loaded.dtype}, expected {kind} ({target})")


def norm_prologue(rows: NormRows) -> RowPrologue:
    """The gemv_fused prologue of a norm's pending rows (the norm module names its numerics)."""
    residual_out = rows.residual_out if rows.residual is not None else None
    return RowPrologue(rows.norm.prologue_kind, rows.norm.weight, rows.norm.eps, rows.residual, residual_out)


def row_prologue(rows: SiluRows | GatedNormRows) -> tuple[torch.Tensor, RowPrologue]:
    """The GEMV's input rows and the prologue that SiluRows / GatedNormRows ask for."""
    if isinstance(rows, SiluRows):
        return rows.h, RowPrologue("silu_mul")
    return rows.x, RowPrologue("gated_rmsnorm", rows.weight, rows.eps, gate=rows.z, group=rows.group)


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

    def forward_silu_mul(self, x: torch.Tensor | Int8Rows | NormRows) -> torch.Tensor | RowsWithAmax:
        """silu(first shard) * second shard of this gate/up layer's output [T, N / 2] in the kernel's own
        epilogue: int8 rows (W8A8: with the max|out| partials where that epilogue writes them), or rows
        (and NormRows) the kernel can_fuse_norm with silu."""
        sizes = [size for _, size in self.shard_offsets.values()]
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            raise RuntimeError(f"silu_and_mul needs two equal shards, not {sizes}")
        if isinstance(x, Int8Rows):
            out, amax_parts = self.kernel.apply_int8_silu_mul(self, x.q, x.scale, x.dtype, self.bias)
            return out if amax_parts is None else RowsWithAmax(out, amax_parts)
        return self._apply_fused(x, silu=True)

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> bool:
        """Copy one checkpoint tensor (e.g. k_proj.weight) into its slice of the fused parameter."""
        return self.load_weight(param_name, loaded, shard)
