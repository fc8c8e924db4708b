"""The `cuda_ipc_pool` transport's allocator: bookkeeping of aligned chunks of one fixed workspace
(the memory itself is a device tensor, or a bytearray in tests)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

POOL_ALIGNMENT = 256  # chunk offsets and sizes: enough for any dtype view and for coalesced copies


@dataclass(frozen=True)
class PoolChunk:
    offset: int
    size: int  # bytes reserved: the request rounded up to the alignment
    generation: int  # unique per allocation: (offset, generation) names one use of the chunk


class PoolAllocator:
    """Best fit over aligned ranges of a fixed workspace of `size` bytes; adjacent free ranges merge on
    free. `free(offset, generation)` frees only the allocation it names, so a stale acknowledgement of
    an earlier use of the same offset is refused. The bytes in use never exceed the size."""

    def __init__(self, size: int, alignment: int = POOL_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment}")
        self.alignment = alignment
        self.size = size - size % alignment
        self._starts: list[int] = [0] if self.size > 0 else []  # free ranges' offsets, sorted
        self._free: dict[int, int] = {0: self.size} if self.size > 0 else {}  # offset -> length
        self._live: dict[int, PoolChunk] = {}
        self._generation = 0
        self.bytes_in_use = 0

    def allocate(self, nbytes: int) -> PoolChunk | None:
        """The smallest free range that fits `nbytes` (its start), or None when none does."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = -(-nbytes // self.alignment) * self.alignment
        best = -1
        for i, start in enumerate(self._starts):
            length = self._free[start]
            if length >= need and (best < 0 or length < self._free[self._starts[best]]):
                best = i
                if length == need:
                    break
        if best < 0:
            return None
        start = self._starts[best]
        length = self._free.pop(start)
        if length > need:
            self._starts[best] = start + need
            self._free[start + need] = length - need
        else:
            del self._starts[best]
        self._generation += 1
        chunk = PoolChunk(start, need, self._generation)
        self._live[start] = chunk
        self.bytes_in_use += need
        return chunk

    def free(self, offset: int, generation: int) -> bool:
        """Return one allocation to the free ranges; False (nothing changes) for one that is not live."""
        chunk = self._live.get(offset)
        if chunk is None or chunk.generation != generation:
            return False
        del self._live[offset]
        self.bytes_in_use -= chunk.size
        start, length = offset, chunk.size
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + length:  # merge with the next range
            length += self._free.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] == start:  # and the previous
            self._free[self._starts[i - 1]] += length
        else:
            self._starts.insert(i, start)
            self._free[start] = length
        return True

    @property
    def live_chunks(self) -> int:
        return len(self._live)

    def free_ranges(self) -> list[tuple[int, int]]:
        return [(s, self._free[s]) for s in self._starts]
