"""Linear layers that allocate without initialising and load (possibly fused) checkpoint shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b); weights are filled by the loader, never randomly initialised."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (QKV, gate/up)."""

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        """Copy one checkpoint tensor (e.g. k_proj.weight) into its slice of the fused parameter."""
        offset, size = self.shard_offsets[shard]
        target = self.weight if param_name == "weight" else self.bias
        assert target is not None
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} has {loaded.shape[0]} rows, expected {size}")
        target.data[offset : offset + size].copy_(loaded)
