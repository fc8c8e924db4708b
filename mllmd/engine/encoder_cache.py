"""The vision encoder's outputs, kept by image content so that an image is encoded once.

A chat's image comes back in every later turn, and a prefill split in chunks (or recomputed after a
preemption) needs an image's rows again: each entry holds one image's embeddings and deepstack rows on
the device, up to `max_bytes` in all, least recently used out first. Entries the current step uses
are never evicted by that step's own insertions (`pin`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Entry = tuple[torch.Tensor, list[torch.Tensor]]  # embeds [n, H], deepstack k x [n, H]


def _nbytes(entry: Entry) -> int:
    embeds, deepstack = entry
    return embeds.numel() * embeds.element_size() + sum(d.numel() * d.element_size() for d in deepstack)


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._bytes = 0
        self._pinned: set[bytes] = set()
        self.hits = self.misses = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def pin(self, keys: set[bytes]) -> None:
        """Keep `keys` until unpin() (the entries one step reads)."""
        self._pinned = set(keys)

    def unpin(self) -> None:
        self._pinned = set()

    def put(self, key: bytes, entry: Entry) -> None:
        """Insert (or refresh) an entry, evicting the least recently used unpinned ones to fit; an entry
        larger than the whole cache is used by its step only and not kept."""
        if key in self._entries:
            self._bytes -= _nbytes(self._entries.pop(key))
        size = _nbytes(entry)
        for old in list(self._entries):
            if self._bytes + size <= self.max_bytes:
                break
            if old not in self._pinned:
                self._bytes -= _nbytes(self._entries.pop(old))
        if self._bytes + size <= self.max_bytes:
            self._entries[key] = entry
            self._bytes += size

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
