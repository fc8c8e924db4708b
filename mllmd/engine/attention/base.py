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
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer_id: int,
        scale: float,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Store k/v at batch.out_cache_loc in layer `layer_id`, then return attention output."""

    def forward_with_amax(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(), and for a decode step of one row, float32 partials whose max is max|output|
        where the backend's kernel writes them (else None): a W8A8 output projection that quantizes
        the row in its own launch takes its scale from them instead of reading the row twice."""
        return self.forward(q, k, v, layer_id, scale, batch), None
