"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mllmd.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over the KV pool: writes the step's K/V, then attends causally.

    `supports_cuda_graph`: decode steps may be captured and replayed (the backend reads no host
    values that change from step to step, and never synchronises with the device).
    """

    supports_cuda_graph: bool = True

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata once (shared by all layers); stores it in batch.attn_metadata."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D] (None with kv_stored)
        v: torch.Tensor | None,  # [T, Hkv, D] (None with kv_stored)
        layer_id: int,
        scale: float,
        batch: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v at batch.out_cache_loc in layer `layer_id` (unless the caller already did:
        `kv_stored`), then return attention output."""

    def forward_with_amax(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, scale: float,
        batch: ForwardBatch, kv_stored: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """forward(), and for a decode step of one row, float32 partials whose max is max|output|
        where the backend's kernel writes them (else None): a W8A8 output projection that quantizes
        the row in its own launch takes its scale from them instead of reading the row twice."""
        return self.forward(q, k, v, layer_id, scale, batch, kv_stored), None

    @staticmethod
    def store_kv(layer_id: int, batch: ForwardBatch, k: torch.Tensor | None, v: torch.Tensor | None, kv_stored: bool) -> None:
        """forward's first step: k/v into the pool at batch.out_cache_loc, unless the caller did (kv_stored)."""
        if not kv_stored:
            assert k is not None and v is not None, "k and v are needed unless kv_stored"
            batch.kv_pool.store(layer_id, batch.out_cache_loc, k, v)

    def kv_cache_target(self, layer_id: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where `forward` stores this step's K/V: (k_cache [S, Hkv, D], v_cache, slots [T] int64), for a
        kernel that writes them itself (the fused RoPE) and then calls forward with kv_stored=True."""
        pool = batch.kv_pool
        return pool.k_buffer[layer_id], pool.v_buffer[layer_id], batch.out_cache_loc
