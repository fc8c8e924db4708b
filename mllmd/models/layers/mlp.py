"""The SwiGLU MLP of the Qwen families: down(silu(gate(x)) * up(x)), gate and up as one fused projection.

Where the activation runs is set by the fusion plan (fusion.py) from what the kernels take: in the
gate/up launch's epilogue (W8A8 one-row int8 rows; W4A16 on the CUDA kernel for one bf16 row, with
the norm before it too), in a launch that also quantizes the result for a W8A8 down projection
(several rows), in a dense down projection's one-row GEMV as it loads its input, or on its own.
"""

from __future__ import annotations

import torch
from mllmd_kernels import silu_and_mul_int8
from mllmd_kernels.gemv_fused import RowPrologue
from torch import nn

from mllmd.models.layers.activation import SiluAndMul
from mllmd.models.layers.fused_inputs import Int8Rows, NormRows, SiluRows
from mllmd.models.layers.linear import Linear, MergedLinear
from mllmd.models.quantization import QuantConfig, get_linear_scheme


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, quant: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:  # fmt: skip
        super().__init__()
        gate_up_scheme = get_linear_scheme(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, dtype=dtype, quant=gate_up_scheme
        )
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, quant=get_linear_scheme(quant, f"{prefix}.down_proj"))
        self.act = SiluAndMul()
        # Set by the fusion plan (all off: the plain route).
        self.silu_in_gate_up = False  # the gate/up kernel applies the activation where it can_fuse_norm
        self.int8_activation = False  # several rows: silu_and_mul_int8 quantizes for the W8A8 down projection
        self.silu_in_down = False  # one row: a dense down projection's GEMV applies the activation itself

    def forward(self, x: torch.Tensor | Int8Rows | NormRows) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if isinstance(x, Int8Rows) and x.q.shape[0] == 1:
            # W8A8, one row: the gate/up gemv applies silu(gate) * up in its epilogue, and the down
            # gemv quantizes that row itself (no silu_and_mul launch between them).
            return self.down_proj(gate_up.forward_silu_mul(x))
        if self.silu_in_gate_up and (isinstance(x, NormRows) or gate_up.can_fuse_norm(x, None, True)):
            return self.down_proj(gate_up.forward_silu_mul(x))  # W4A16 CUDA kernel, one bf16 row
        h = gate_up(x)
        # W8A8 on the GPU: activate and quantize in one launch. Not for one row: silu_and_mul_int8's
        # single program is latency-bound there, and the one-row gemv quantizes its input itself.
        if self.int8_activation and h.dim() == 2 and h.shape[0] > 1:
            return self.down_proj(Int8Rows(*silu_and_mul_int8(h), h.dtype))
        if self.silu_in_down and self.down_proj.takes_rows(h, RowPrologue("silu_mul")):
            return self.down_proj(SiluRows(h))
        return self.down_proj(self.act(h))
