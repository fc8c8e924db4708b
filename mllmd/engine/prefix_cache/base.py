"""The prefix-cache interface shared by ``RadixCache`` and ``ChunkCache``.

A prefix cache maps token-id sequences to the KV-slot indices (int64, one per token) that hold
their KV, so a request that starts with a cached prefix can skip recomputing it. The cache never
allocates slots; it frees slots only through the ``free_slots`` callback it is given.

Ownership contract (identical for every implementation, so the scheduler has one code path)
------------------------------------------------------------------------------------------
Every slot is owned by exactly one party at a time: the allocator (free), a request, or the cache.

1. ``m = cache.match_prefix(key)``: the slots in ``m.indices`` stay owned by the cache. A request
   that reuses them calls ``cache.inc_lock_ref(m.last_node)`` so they cannot be evicted, and must
   never free them itself.
2. The request allocates fresh slots for ``key[len(m.indices):]``; it owns those.
3. When the request finishes it calls, with ``value = cat(m.indices, fresh_slots)``::

       n = cache.insert(key, value)
       free_slots(value[len(m.indices):n])   # its own slots that duplicate already-cached KV
       cache.dec_lock_ref(m.last_node)

   ``insert`` returns ``n``, how many leading tokens of ``key`` were already cached
   (``n >= len(m.indices)`` while ``m.last_node`` is locked). The slots ``value[:n]`` are NOT
   taken by the cache: the first ``len(m.indices)`` of them are the cache's own (from step 1) and
   the rest are the caller's duplicates, which the caller frees. The cache takes ownership of
   ``value[n:]``; from then on it frees them (via ``free_slots``) on eviction or flush.

   * ``RadixCache`` keeps ``value[n:]`` (it copies the tensor, so the caller may reuse ``value``).
   * ``ChunkCache`` caches nothing: ``match_prefix`` is always empty and ``insert`` returns 0 and
     frees all of ``value`` through ``free_slots`` at once. The caller's ``value[0:0]`` free is empty,
     so the same code path frees every slot of a finished request exactly once.

4. Unfinished requests (chunked prefill): inserting a prefix that the request keeps using is only
   valid when ``cache.enabled`` (the radix cache then owns the slots; the request re-matches and
   locks the new node, and replaces its own duplicate slots by the returned ``m.indices``). With
   ``ChunkCache`` such an insert would free slots that are still in use, so skip it when
   ``not cache.enabled``.

``free_slots`` always receives a fresh int64 tensor (never a view of caller or cache storage).
Sizes are in tokens (== slots, page size 1): ``evictable_size() + protected_size() == total_size()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

FreeSlotsFn = Callable[[torch.Tensor], None]


@dataclass
class MatchResult:
    """The longest cached prefix of a key."""

    indices: torch.Tensor  # [n] int64 slot indices of the matched prefix (empty when n == 0)
    last_node: Any  # node to lock with inc_lock_ref/dec_lock_ref; the root when n == 0
    state: int | None = None  # hybrid models: the state-pool slot with the state after the prefix


class PrefixCache(ABC):
    """Abstract prefix cache over KV-slot indices (see the module docstring for ownership)."""

    enabled: bool = False

    def __init__(self, free_slots: FreeSlotsFn, device: torch.device | str = "cpu") -> None:
        self.free_slots = free_slots
        self.device = torch.device(device)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``key``; refreshes the LRU time of the matched path."""

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache ``value`` ([len(key)] slots) for ``key``; return the already-cached prefix length.

        The cache takes ownership of ``value[returned:]``; ``value[:returned]`` stays the caller's
        business (see the module docstring).
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Lock ``node`` and all its ancestors against eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one ``inc_lock_ref(node)``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked slots if possible (LRU leaves first).

        Calls ``free_slots`` at most once per call, with all freed slots concatenated.
        Returns the number of slots freed.
        """

    @abstractmethod
    def flush(self) -> int:
        """Evict every unlocked entry; return the number of slots freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached in unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens cached in locked nodes."""

    def total_size(self) -> int:
        """Tokens (slots) held by the cache."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def held_slots(self) -> torch.Tensor:
        """All slots the cache owns, concatenated (for leak checks and debugging)."""
