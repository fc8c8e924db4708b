"""The fusion plan: which op hands what to the next, decided once per model after its weights load.

A decoder layer names the producer -> consumer pairs that may fuse (`FUSABLE`, submodule paths);
the model's other layers (GatedMLP, RotaryAttention) carry their own routes. Every capability check
lives here, read from the kernels the quantized layers chose for their device:

* RMSNorm -> W8A8 Linear (Triton kernel): the norm quantizes its output per token in its launch.
* RMSNorm -> W4A16 Linear (CUDA kernel, bf16): the projection's launch applies the norm for one row
  (and, into gate/up, silu(gate) * up after it); off with MLLMD_W4A16_FUSIONS=0.
* RotaryAttention -> W8A8 Linear: the decode attention writes max|out| partials the one-row gemv
  takes its scale from.
* RotaryAttention: on CUDA the rope kernel writes K/V into the pool itself (when the pool has the
  dtype the kernel returns).
* GatedMLP: the activation in the gate/up epilogue (W4A16 CUDA kernel), or quantized for a W8A8
  down projection in the activation's launch.
* Dense (bf16 / fp16) projections, one row (batch-1 decode): the one-row GEMV applies the op before
  it as it loads its input (mllmd_kernels.gemv_fused): the RMSNorm or zero-centred RMSNorm (with the
  residual add) before qkv / the DeltaNet in_proj / gate/up, SiLU-and-mul before down, the DeltaNet's
  gated RMSNorm before its out_proj; only with MLLMD_GEMV_FUSIONS=1 (it measured slower than the
  separate launches on the H200, so it is off by default).

Model files know none of this: they call their layers on plain tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from mllmd import knobs
from mllmd.models.layers.attention import RotaryAttention
from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.gated_deltanet import GatedDeltaNet
from mllmd.models.layers.linear import Linear
from mllmd.models.layers.mlp import GatedMLP
from mllmd.models.layers.norm import RMSNorm, ZeroCentredRMSNorm

# Whether the rope kernel stores K/V itself (where the pool's dtype allows); False leaves the store
# to the attention step (tests compare the routes).
ROPE_STORES_KV = True


def _kernel_has(linear: Linear, capability: str) -> bool:
    kernel = linear.quant_method.kernel if linear.quant_method is not None else None
    return kernel is not None and bool(getattr(kernel, capability, False))


def _dense_gemv(linear: Linear) -> bool:
    """A dense projection whose one-row inputs go through the Triton GEMV, which can apply the op
    before it (gemv_fused): no bias, 16-bit weights, on a device where the Triton kernels run."""
    weight = getattr(linear, "weight", None)
    return (linear.quant_method is None and linear.bias is None and isinstance(weight, torch.Tensor)
            and weight.dtype in (torch.bfloat16, torch.float16) and fused_kernels(weight))  # fmt: skip


def plan_fusions(
    model: nn.Module, kv_dtype: torch.dtype | None = None, w4a16_fusions: bool | None = None,
    gemv_fusions: bool | None = None,
) -> None:  # fmt: skip
    """Set every route of `model` (again, from scratch: a plan may be redone after a kernel changes).
    `kv_dtype`: the KV pool's dtype (None: the model's own); `w4a16_fusions` / `gemv_fusions`: the
    W4A16 kernel's and the dense one-row GEMV's fusions (None: MLLMD_W4A16_FUSIONS / MLLMD_GEMV_FUSIONS)."""
    fuse = knobs.W4A16_FUSIONS if w4a16_fusions is None else w4a16_fusions
    dense = knobs.GEMV_FUSIONS if gemv_fusions is None else gemv_fusions
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.int8_output, module.fused_into = False, None
        elif isinstance(module, ZeroCentredRMSNorm):
            module.fused_into = None
        elif isinstance(module, RotaryAttention):
            module.out_absmax = False
            module.rope_stores_kv = ROPE_STORES_KV and kv_dtype in (None, module.dtype)
        elif isinstance(module, GatedMLP):
            module.silu_in_gate_up = fuse and _kernel_has(module.gate_up_proj, "fuses_silu_mul")
            module.int8_activation = _kernel_has(module.down_proj, "takes_int8_input")
            module.silu_in_down = dense and not module.silu_in_gate_up and _dense_gemv(module.down_proj)
        elif isinstance(module, GatedDeltaNet):
            module.norm_in_out_proj = dense and _dense_gemv(module.out_proj)
    for layer in model.modules():
        for producer_name, consumer_name in getattr(layer, "FUSABLE", {}).items():
            producer, consumer = layer.get_submodule(producer_name), layer.get_submodule(consumer_name)
            if not isinstance(consumer, Linear):
                continue
            if isinstance(producer, RMSNorm) and _kernel_has(consumer, "takes_int8_input"):
                producer.int8_output = True
            elif isinstance(producer, RMSNorm) and fuse and _kernel_has(consumer, "fuses_norm"):
                producer.fused_into = (consumer, _feeds_silu(layer, consumer))
            elif isinstance(producer, (RMSNorm, ZeroCentredRMSNorm)) and dense and _dense_gemv(consumer):
                producer.fused_into = (consumer, False)
            elif isinstance(producer, RotaryAttention):
                producer.out_absmax = _kernel_has(consumer, "takes_amax")


def _feeds_silu(layer: nn.Module, consumer: Linear) -> bool:
    """Whether `consumer` is the gate/up projection of a GatedMLP whose activation runs in its launch."""
    return any(isinstance(m, GatedMLP) and m.gate_up_proj is consumer and m.silu_in_gate_up for m in layer.modules())
