"""Rotary position embedding (non-interleaved, "rotate_half" layout as in Hugging Face Qwen3).

A model computes its step's `RopeTable` once (`rotary.table(positions)`) and every attention layer
rotates with it: row index[t] of cos / sin rotates token t. For plain positions that is the cached
table indexed by position; M-RoPE (mrope.py) builds per-token rows for 3-axis positions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeTable(NamedTuple):
    """A step's rotation: token t uses cos[index[t]], sin[index[t]] ([X, rotary_dim] fp32 rows, the
    first and second half equal, as rotate_half pairs them)."""

    cos: torch.Tensor
    sin: torch.Tensor
    index: torch.Tensor  # [T] int64


def apply_rope(table: RopeTable, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated on their first rotary_dim (= the table's width) dims, in q's
    dtype (as transformers rounds); the other dims pass through."""
    cos = table.cos[table.index].to(q.dtype).unsqueeze(1)  # [T, 1, R]
    sin = table.sin[table.index].to(q.dtype).unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def one(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)

    return one(q), one(k)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at integer positions [T]."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def table(self, positions: torch.Tensor) -> RopeTable:
        """The step's rotation for integer positions [T]."""
        return RopeTable(self.cos_cache, self.sin_cache, positions)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(self.table(positions), q, k)


def get_rope(head_dim: int, max_position: int, config: Any) -> RotaryEmbedding:
    """Build the RoPE module a Hugging Face config asks for (default RoPE only, for now)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet")
    theta = params.get("rope_theta") if params else None
    if theta is None:
        theta = getattr(config, "rope_theta", 10000.0)
    return RotaryEmbedding(head_dim, max_position, float(theta))
