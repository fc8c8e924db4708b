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
