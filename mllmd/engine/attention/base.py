"""The interface every attention backend implements, and the per-step object the model layers use.

A backend owns nothing of the model: it is built over one KV pool and request-to-token table, and
for each step `plan(batch)` returns a `PagedAttentionStep` (the model's `AttentionStep`): where the
step's K/V go, and attention over the pool with the step's metadata, built once for all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from mllmd.engine.forward_batch import ForwardBatch
from mllmd.engine.memory import KVPool


class AttentionBackend(ABC):
    """Paged attention over `kv_pool`, reading each request's slots from `req_to_token` [R, L].

    `supports_cuda_graph`: decode steps may be captured and replayed (the backend reads no host
    values that change from step to step, and never synchronises with the device); `prepare_replay`
    runs before each replay for backends whose device-side metadata must be refreshed.
    `supports_prefill_graph`: so may prefill and mixed steps, padded (rows of extend length 0 and
    tokens past the last row's, which no row attends to) and planned for the bucket's token count.
    """

    supports_cuda_graph: bool = True
    supports_prefill_graph: bool = False

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def plan(self, batch: ForwardBatch) -> PagedAttentionStep:
        """The step's attention, its metadata built once for every layer."""
        return PagedAttentionStep(self, batch, self.metadata(batch))

    @abstractmethod
    def metadata(self, batch: ForwardBatch) -> Any:
        """Per-step metadata (shared by all layers)."""

    @abstractmethod
    def attend(
        self, step: PagedAttentionStep, layer: int, q: torch.Tensor, scale: float, out_absmax: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, Hq, D] over the pool's layer `layer` (this step's K/V already stored) -> (out [T, Hq, D],
        and with `out_absmax` float32 partials whose max is max|out| where the backend's kernel writes
        them, else None)."""

    def fresh_route_pays(self, tokens: int, q_heads: int, head_dim: int) -> bool:
        """One row of `tokens` tokens with no prefix has a faster route of its own, which a prefill graph
        of that bucket may capture (replayed only by such rows); False by default."""
        return False

    def prefers_eager(self, prefix_lens: list[int], extend_lens: list[int], q_heads: int, head_dim: int) -> bool:
        """A prefill step of these rows runs faster eagerly than as a padded prefill graph (a route the
        backend takes only outside graphs); False by default."""
        return False

    def prepare_replay(self, step: PagedAttentionStep) -> None:  # noqa: B027 (optional hook)
        """Refresh device-side metadata before a CUDA graph of `step` replays (nothing by default)."""


class PagedAttentionStep:
    """One step's attention (mllmd.models.layers.attention.AttentionStep), as a backend planned it."""

    __slots__ = ("backend", "batch", "meta", "pool")

    def __init__(self, backend: AttentionBackend, batch: ForwardBatch, meta: Any) -> None:
        self.backend, self.batch, self.meta, self.pool = backend, batch, meta, backend.kv_pool

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pool.k_buffer[layer], self.pool.v_buffer[layer], self.batch.out_cache_loc

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.store(layer, self.batch.out_cache_loc, k, v)

    def attend(
        self, layer: int, q: torch.Tensor, scale: float, out_absmax: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.backend.attend(self, layer, q, scale, out_absmax)
