"""The prefix cache used when radix caching is disabled: it caches nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mllmd.engine.prefix_cache.base import FreeSlotsFn, MatchResult, PrefixCache


class ChunkCache(PrefixCache):
    """No-op cache: never matches; ``insert`` frees every slot it is given and returns 0.

    With the caller protocol in ``base`` (free ``value[len(m.indices):n]`` after ``insert``) this
    frees each slot of a finished request exactly once. Do not ``insert`` slots a request still
    uses (check ``enabled``).
    """

    enabled = False

    def __init__(self, free_slots: FreeSlotsFn, device: torch.device | str = "cpu") -> None:
        super().__init__(free_slots, device)
        self.root = None  # the "node" every match returns; lock ops ignore it

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(indices=self._empty(), last_node=self.root)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        if value.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        if value.numel():
            self.free_slots(value.to(torch.int64, copy=True))  # never hand out a view of the caller's
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def held_slots(self) -> torch.Tensor:
        return self._empty()
