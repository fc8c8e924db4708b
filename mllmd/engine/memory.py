"""KV memory: request slots, the token-slot allocator and the per-layer K/V pool.

Slot 0 of the KV pool is reserved as a padding target (never handed out), so padded batch rows can
write somewhere harmless.
"""

from __future__ import annotations

import torch
from mllmd_kernels import store_cache


class ReqToTokenPool:
    """Maps (request slot, token position) -> KV slot index."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)  # [R, L]
        self._free: list[int] = list(range(size))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)


class TokenToKVPoolAllocator:
    """Free list of KV slot indices 1..size (slot 0 is padding); frees can be batched."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)  # [num_free]
        self._pending: list[torch.Tensor] = []
        self._batching = 0

    def available_size(self) -> int:
        return int(self._free.numel()) + sum(int(t.numel()) for t in self._pending)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n slots, or None (nothing taken) when fewer are free."""
        if n > self._free.numel() and self._pending:
            self._flush()
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        if self._batching:
            self._pending.append(indices)
        else:
            self._free = torch.cat([self._free, indices.to(self._free.device)])

    def begin_free_group(self) -> None:
        """Collect frees until end_free_group() and return them with one concatenation."""
        self._batching += 1

    def end_free_group(self) -> None:
        self._batching -= 1
        if self._batching == 0:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._free = torch.cat([self._free, *[t.to(self._free.device) for t in self._pending]])
            self._pending = []


class KVPool:
    """Per-layer K and V buffers of shape [size + 1, num_kv_heads, head_dim]."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_cache(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)
