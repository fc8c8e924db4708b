"""Every CUDA call of the `cuda_ipc` and `cuda_ipc_pool` tensor transports, in one place (the tests
substitute a CPU fake for `CudaBackend`). torch is imported here only when a backend is made."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from mllmd.messages import CudaIpcStorage


def _from_numpy(a: np.ndarray) -> Any:
    import torch

    with warnings.catch_warnings():  # a read-only array is only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class CudaBackend:
    """Copies go on one side stream per device; the receiver's copies record an event each, which
    `query` polls. Releasing a mapped IPC storage makes torch synchronise the *current* stream of its
    device, so `releasing` makes an idle stream current first (the sync then waits for nothing)."""

    def __init__(self, device: Any = None) -> None:
        import torch

        self.torch = torch
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise ValueError(f"the CUDA transport modes need a CUDA device, not {dev}")
        torch.cuda.init()  # _new_shared_cuda may be the process's first CUDA call
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self._streams: dict[int, Any] = {}
        self._idle: dict[int, Any] = {}

    def stream(self, index: int) -> Any:
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = self.torch.cuda.Stream(device=index)
        return s

    def releasing(self, index: int) -> Any:
        s = self._idle.get(index)
        if s is None:
            s = self._idle[index] = self.torch.cuda.Stream(device=index)
        return self.torch.cuda.stream(s)

    def _tensor(self, src: Any) -> Any:
        return _from_numpy(src) if isinstance(src, np.ndarray) else src

    # sender
    def upload(self, src: Any) -> Any:
        """A fresh contiguous copy of `src` on the sender's device (from host memory the copy is done when
        this returns; from a device tensor it is ordered after the caller's stream)."""
        torch = self.torch
        t = self._tensor(src)
        s = self.stream(self.device.index)
        if t.is_cuda:
            s.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(s):
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            out.copy_(t)
        if t.is_cuda:
            t.record_stream(s)
        return out

    def export(self, t: Any) -> CudaIpcStorage:
        """The IPC description of `t`'s storage; torch records its event on the current stream, which is
        the side stream that wrote `t`."""
        with self.torch.cuda.stream(self.stream(t.device.index)):
            dev, handle, size, offset, rc, rc_offset, event, sync = t.untyped_storage()._share_cuda_()
        return CudaIpcStorage(int(dev), bytes(handle), int(size), int(offset), bytes(rc), int(rc_offset),
                              bytes(event), bool(sync))

    def alloc_pool(self, nbytes: int) -> Any:
        with self.torch.cuda.stream(self.stream(self.device.index)):
            return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def write(self, pool: Any, offset: int, src: Any, nbytes: int) -> tuple[Any, bytes]:
        """Copy `src`'s bytes into pool[offset:], then record an interprocess event after the copy.
        Returns (what must live until the ack, the event's IPC handle)."""
        torch = self.torch
        t = self._tensor(src).reshape(-1).view(torch.uint8)
        s = self.stream(pool.device.index)
        if t.is_cuda:
            s.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(s):
            pool[offset:offset + nbytes].copy_(t)
            event = torch.cuda.Event(interprocess=True)
            event.record(s)
        if t.is_cuda:
            t.record_stream(s)
        return event, bytes(event.ipc_handle())

    def release_counter(self, storage: CudaIpcStorage) -> None:
        """Drop the receiver's reference in torch's counter (for a receiver that died holding it)."""
        self.torch.UntypedStorage._release_ipc_counter_cuda(storage.ref_counter_handle, storage.ref_counter_offset)

    # receiver
    def open_storage(self, s: CudaIpcStorage) -> tuple[Any, Any]:
        """(a uint8 tensor over the sender's storage, the sender's event to wait on or None). torch's own
        wait (event_sync_required) would go on the current stream and leak the opened event: ours goes
        on the copy stream and the event is freed with its object."""
        torch = self.torch
        dev = torch.device("cuda", s.device)
        wait = torch.cuda.Event.from_ipc_handle(dev, s.event_handle) if s.event_sync_required else None
        storage = torch.UntypedStorage._new_shared_cuda(
            s.device, s.handle, s.size_bytes, s.offset_bytes, s.ref_counter_handle, s.ref_counter_offset,
            s.event_handle, False,
        )
        return torch.empty(0, dtype=torch.uint8, device=dev).set_(storage), wait

    def open_event(self, index: int, handle: bytes) -> Any:
        return self.torch.cuda.Event.from_ipc_handle(self.torch.device("cuda", index), handle)

    def copy_out(self, src: Any, waits: list[Any], device: Any) -> tuple[Any, Any]:
        """A copy of `src` on `device`, after `waits`: (the tensor, its copy's event, None when the copy
        already finished). On a CUDA device the copy runs on the copy stream, into memory allocated
        there; the caller's current stream waits for it, and the tensor is marked as used by that stream
        so that its block is not reused before the caller is done with it."""
        torch = self.torch
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            cs = self.stream(dev.index)
            current = torch.cuda.current_stream(dev)
            with torch.cuda.stream(cs):
                for event in waits:
                    cs.wait_event(event)
                out = torch.empty(src.shape, dtype=src.dtype, device=dev)
                out.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(cs)
            current.wait_event(done)
            out.record_stream(current)
            return out, done
        cs = self.stream(src.device.index)
        with torch.cuda.stream(cs):
            for event in waits:
                cs.wait_event(event)
            out = src.to(dev)  # a blocking copy to the host: finished when it returns
        return out, None

    def from_host(self, src: Any, device: Any) -> Any:
        """A copy of host tensor `src` on CUDA `device`, finished when this returns (a blocking copy on the
        copy stream: the caller's stream, busy with the model, is not synchronised)."""
        torch = self.torch
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        current = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self.stream(dev.index)):
            out = torch.empty(src.shape, dtype=src.dtype, device=dev)
            out.copy_(src)
        out.record_stream(current)
        return out

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def cuda_backend(device: Any) -> CudaBackend | None:
    """A CudaBackend, or None where torch has no CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return CudaBackend(device)
