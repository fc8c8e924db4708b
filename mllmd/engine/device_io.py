"""Host <-> device transfers that never block the host on the GPU's queue.

On CUDA a plain ``torch.tensor(data, device="cuda")`` or ``t.tolist()`` copies through pageable
memory and synchronises the stream. Inside an engine step every input goes up through pinned memory
with ``non_blocking=True`` (the caching host allocator keeps the pinned block alive until the copy has
run), and the step's results come back into pinned buffers followed by one event wait: the only point
where the host waits for the GPU. On CPU these are the plain operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of `data` (nested lists, a numpy array or a CPU tensor) on `device`, without a host sync
    on CUDA."""
    dev = torch.device(device)
    if isinstance(data, np.ndarray):  # torch.tensor(array, pin_memory=True) refuses numpy input
        data = torch.from_numpy(np.ascontiguousarray(data))
    if dev.type != "cuda":
        if isinstance(data, torch.Tensor):
            return data.to(device=dev, dtype=dtype)
        return torch.tensor(data, dtype=dtype, device=dev)
    if isinstance(data, torch.Tensor):
        host = data.to(dtype=dtype)
        host = host if host.is_pinned() else host.pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(dev, non_blocking=True)


ALIGN_BYTES = 16


def to_device_parts(parts: Sequence[Sequence[int | float]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Several flat lists in one staged copy (see to_device); each part starts on a 16-byte boundary.

    Triton specializes a kernel on whether each pointer argument is 16-byte aligned, so a part that
    started mid-word on some steps (after an odd-length part) would compile a second variant of every
    kernel that reads it, in the middle of serving.
    """
    per = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    flat: list[int | float] = []
    starts = []
    for part in parts:
        starts.append(len(flat))
        flat += part
        flat += [0] * (-len(part) % per)
    staged = to_device(flat, dtype, device)
    return [staged[s : s + len(p)] for s, p in zip(starts, parts)]


class PendingFetch:
    """Device tensors on their way to the host: `wait()` returns their `.tolist()` values."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self._slots = [t is not None for t in tensors]
        live = [t for t in tensors if t is not None]
        self._event: torch.cuda.Event | None = None
        if live and live[0].is_cuda:
            hosts = []
            for t in live:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                hosts.append(h)
            self._event = torch.cuda.Event()
            self._event.record()
            live = hosts
        self._live = live

    def wait(self) -> list[list[Any] | None]:
        if self._event is not None:
            self._event.synchronize()  # a wait for this event only (not a stream sync)
        it = iter(self._live)
        return [next(it).tolist() if present else None for present in self._slots]


def fetch(tensors: Sequence[torch.Tensor | None]) -> list[list[Any] | None]:
    """`.tolist()` of each tensor (None stays None); on CUDA through pinned buffers and one event."""
    return PendingFetch(tensors).wait()
