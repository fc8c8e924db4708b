"""store_cache: write one step's new K/V rows into the paged KV pool at their slot indices."""

from __future__ import annotations

import torch


def store_cache_ref(
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    loc: torch.Tensor,  # [T] int64 slot index of each new token
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
) -> None:
    """Torch reference: scatter rows of k/v into the caches (casting to the cache dtype)."""
    k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))


def store_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new K/V rows; the GPU path adds a Triton kernel behind this name."""
    store_cache_ref(k_cache, v_cache, loc, k, v)
