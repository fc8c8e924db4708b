"""Paged attention as a model layer: per-head QK norm, RoPE, the step's K/V into the pool, attention.

The model passes the step's `AttentionStep` (built by the engine's attention backend for each step;
the models never import the engine) down to every attention layer. Which kernels a layer runs is
chosen once, when the model is prepared (`mllmd.models.layers.fusion`): on CUDA with Triton the
QK-norm, RoPE and the K/V store are one launch (the rope kernel writes K/V into the pool) and, where
the output projection quantizes its input itself, attention also writes max|out| partials for it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from mllmd_kernels import rope
from torch import nn

from mllmd.models.layers.dispatch import fused_kernels
from mllmd.models.layers.fused_inputs import RowsWithAmax
from mllmd.models.layers.norm import RMSNorm, ZeroCentredRMSNorm
from mllmd.models.layers.rotary import RopeTable, apply_rope


class AttentionShape(NamedTuple):
    """What the KV pool and the attention backend are sized by: `num_layers` KV layers (the model's
    attention layers) of `num_kv_heads` x `head_dim`, read by `num_heads` query heads."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class AttentionStep(Protocol):
    """One step's attention over the paged KV pool (what the engine's backend prepared)."""

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache [S, Hkv, D], v_cache, slots [T] int64): where this step's K/V of `layer` go."""
        ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k / v [T, Hkv, D] of `layer` into the pool."""
        ...

    def attend(self, layer: int, q: torch.Tensor, scale: float, out_absmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention of q [T, Hq, D] over the pool (the step's K/V stored first) -> (out [T, Hq, D],
        and with `out_absmax`, for a one-row decode, float32 partials whose max is max|out|, else None)."""
        ...


class RotaryAttention(nn.Module):
    """q, k, v of one layer -> attention output [T, Hq * D]: QK norm (when the model has it), RoPE
    (the step's table, on the first `rotary_dim` dims), K/V into the pool, attention. `kv_layer`
    indexes the KV pool (the layer's place among the model's attention layers); `dtype` is the
    model's. The norms belong to the model's attention module (their weights are named there); they
    are referenced here, not registered a second time."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_layer: int,
        dtype: torch.dtype,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_layer = kv_layer
        self.dtype = dtype  # what the rope kernel returns (and the KV pool must hold for it to store K/V)
        self.rotary_dim = rotary_dim or head_dim
        # the rope kernel applies RMSNorm's or the zero-centred norm's numerics (one kind for q and k)
        # and rotates the table's width of each head (rotary_dim), passing the rest through
        self.fusable_rope = type(q_norm) is type(k_norm) and isinstance(q_norm, (RMSNorm, ZeroCentredRMSNorm, type(None)))
        self.zero_centred_norm = isinstance(q_norm, ZeroCentredRMSNorm)
        self.scale = head_dim**-0.5
        self._norms = (q_norm, k_norm)  # a tuple: not submodules of this one
        # Set by the fusion plan: the rope kernel stores K/V itself; attention writes max|out| partials.
        self.rope_stores_kv = False
        self.out_absmax = False

    def forward(
        self, rope_table: RopeTable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: AttentionStep
    ) -> torch.Tensor | RowsWithAmax:
        """q [T, Hq * D] or [T, Hq, D], k / v [T, Hkv * D] (views into a fused qkv output are fine: the
        rope kernel reads them in place)."""
        q_norm, k_norm = self._norms
        if q.dim() == 2:
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        layer = self.kv_layer
        if self.fusable_rope and fused_kernels(q):  # QK-norm and RoPE in one Triton launch
            cos, sin, index = rope_table
            qw = q_norm.weight if q_norm is not None else None
            kw = k_norm.weight if k_norm is not None else None
            eps = q_norm.eps if q_norm is not None else 1e-6
            zc = self.zero_centred_norm
            if self.rope_stores_kv:
                k_cache, v_cache, slots = step.kv_cache(layer)
                q, _ = rope(index, q, k, cos, sin, qw, kw, eps, kv_cache=(v, k_cache, v_cache, slots), zero_centred_norm=zc)
            else:
                q, k = rope(index, q, k, cos, sin, qw, kw, eps, zero_centred_norm=zc)
                step.store(layer, k, v)
        else:
            if q_norm is not None and k_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = apply_rope(rope_table, q, k)
            step.store(layer, k, v)
        out, amax = step.attend(layer, q, self.scale, self.out_absmax)  # [T, Hq, D]
        out = out.reshape(-1, self.num_heads * self.head_dim)
        return out if amax is None else RowsWithAmax(out, amax)
