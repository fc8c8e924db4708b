"""Tensors from the tokenizer worker to the scheduler worker, chosen by `ipc.tensor_transport_mode`.

What crosses for an image is its resized uint8 pixels (3·H·W bytes, 8x smaller than the fp32
pixel_values, which duplicate each frame for the temporal patch); normalisation and patch cutting
happen on the scheduler's device. `TensorSender` (tokenizer worker) turns an array into a
`TensorHandle` that rides in a message; `TensorReceiver` (scheduler worker) turns the handle into a
tensor it owns, and returns the handle's id in a `TransportAck` once its copy has finished.

Modes and the reasons behind them:
- `default`: POSIX shared memory, unlinked by the receiver right after its copy. The receiver is the
  only process that knows when the bytes are no longer needed, and a segment unlinked there cannot
  outlive either process. Both sides keep Python's resource tracker out of it (`shm.py` says why),
  and the sender keeps a bounded registry of the segments not yet acknowledged, which it unlinks when
  it closes, resets or exits; a new sender unlinks the segments of senders that died.
- `cuda_ipc`: the sender copies the tensor to its device on a side stream and exports it
  (`storage._share_cuda_()` records an interprocess event on that stream, after the copy). The
  receiver waits on the event in its copy stream, copies into a tensor of its own and acknowledges
  when that copy has finished; only then does the sender drop its tensor. Each tensor costs the
  receiver an IPC open of the sender's allocation, and torch keeps an exported block in limbo until
  every receiver released it: a receiver that dies holding one leaks it until the sender exits.
- `cuda_ipc_pool`: one workspace of `cuda_ipc_pool_size_mb`, allocated and exported once, split into
  aligned chunks (best fit, merged on free). The sender copies a tensor into a chunk and records an
  interprocess event after the copy; the receiver maps the workspace once per pool id and keeps the
  mapping (opening an IPC handle is the expensive part of per-tensor IPC; a mapping opened per
  tensor also made the consumer sync on every release), waits on the event, copies out, and the
  chunk returns to the allocator when the ack arrives. A chunk's generation names one use of it, so
  a stale or repeated ack cannot free the chunk's next use.
Acknowledgements wait for the receiver's copy to finish, never for its enqueue: a receiver that
acknowledged right after launching its copy let the sender overwrite a chunk the copy was still
reading (the race that SGLang's pool transport shipped with). `pending_acks()` queries the copy events
and returns only the finished ones.

Fallbacks: a full pool sends that tensor by `cuda_ipc`; more than `max_inflight` unacknowledged IPC
tensors send it by `default`; a sender without CUDA uses `default`. The daemon probes CUDA IPC at start
and resolves the mode against it (`transport_probe.py`).

Beside this module: `shm.py` (the segments), `pool_allocator.py` (the pool's chunks), `cuda_ipc.py`
(every CUDA call of the two CUDA modes).

torch is imported only by the CUDA modes and by the receiver: the `default` sender needs numpy alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from mllmd.messages import CudaIpcStorage, CudaIpcTensor, PoolTensor, ShmTensor, TensorHandle, TransportAck
from mllmd.multimodal import shm
from mllmd.multimodal.cuda_ipc import cuda_backend
from mllmd.multimodal.pool_allocator import PoolAllocator, PoolChunk
from mllmd.multimodal.shm import SHM_PREFIX

logger = logging.getLogger("mllmd.transport")

MODES = ("default", "cuda_ipc", "cuda_ipc_pool")
# Unacknowledged tensors per mechanism (segments, IPC tensors, pool chunks). It keeps a receiver that fell
# behind or died from pinning unbounded memory, and stays under torch's 1,000 interprocess events per process.
MAX_INFLIGHT = 256
MIB = 1 << 20
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DTYPES = tuple(ITEMSIZE)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class TransportError(RuntimeError):
    """A handle that cannot be received (segment gone, malformed), or a tensor that cannot be sent."""


class TransportFull(TransportError):
    """Too many tensors in flight without an acknowledgement: the receiver is behind or gone (a 503)."""


# ---- arrays in, dtypes ------------------------------------------------------------------------------
def _source(x: Any) -> tuple[Any, tuple[int, ...], str, int]:
    """x as (a C-contiguous numpy array or torch tensor, shape, dtype name, nbytes)."""
    if isinstance(x, np.ndarray):
        src: Any = x if x.flags.c_contiguous else x.copy(order="C")  # ascontiguousarray makes 0-d 1-d
        if not src.dtype.isnative:
            src = src.astype(src.dtype.newbyteorder("="))
        dtype = src.dtype.name
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            raise TypeError(f"can send a numpy array or a torch tensor, not {type(x).__name__}")
        src = x.detach().contiguous()
        dtype = str(src.dtype).removeprefix("torch.")
    if dtype not in ITEMSIZE:
        raise TypeError(f"cannot send dtype {dtype}; one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in src.shape)
    return src, shape, dtype, math.prod(shape) * ITEMSIZE[dtype]


def _host_bytes(src: Any) -> np.ndarray:
    """The bytes of a contiguous array or tensor as a flat uint8 numpy array (a device tensor is copied
    to the host: what a CUDA-mode sender falling back to shared memory needs)."""
    if isinstance(src, np.ndarray):
        return src.reshape(-1).view(np.uint8)
    import torch

    return src.reshape(-1).view(torch.uint8).cpu().numpy()


def _check_layout(shape: tuple[int, ...], dtype: str, nbytes: int) -> None:
    if dtype not in ITEMSIZE:
        raise TransportError(f"unknown dtype {dtype!r}")
    if any(d < 0 for d in shape) or math.prod(shape) * ITEMSIZE[dtype] != nbytes:
        raise TransportError(f"shape {shape} of {dtype} does not hold {nbytes} bytes")


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None) if name in ITEMSIZE else None
    if not isinstance(dtype, torch.dtype):
        raise TransportError(f"unknown dtype {name!r}")
    return dtype


# ---- sender ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SenderStats:
    mode: str
    live_segments: int  # shared-memory segments not yet acknowledged
    segment_bytes: int
    ipc_inflight: int  # cuda_ipc tensors kept alive for the receiver
    ipc_bytes: int
    pool_size: int
    pool_bytes_in_use: int
    pool_chunks: int
    sent: dict[str, int]  # handles sent: shm, cuda_ipc, pool
    fallbacks: dict[str, int]  # pool_full (sent by cuda_ipc), ipc_full (sent by shared memory)
    stale_acks: int  # acknowledged ids that were not in flight


class TensorSender:
    """Lives in the tokenizer worker. `send` returns a handle for a message; `on_ack` releases what the
    receiver has finished copying; `close` (or `reset`, when the receiver restarted) releases the rest.

    `mode` is the mode in use: `requested` less the fallbacks found at construction (no CUDA: default;
    the pool could not be allocated: cuda_ipc), with `fallback_reason`. `max_inflight` bounds each
    mechanism's unacknowledged tensors: past it the pool and cuda_ipc fall back, and shared memory, the
    last resort, raises TransportFull. Not thread-safe (the tokenizer worker's loop owns it)."""

    def __init__(self, requested: str = "default", device: Any = None, *, pool_size_mb: int = 256,
                 max_inflight: int = MAX_INFLIGHT, name_prefix: str = SHM_PREFIX, sweep: bool = True,
                 backend: Any = None) -> None:
        if requested not in MODES:
            raise ValueError(f"tensor transport mode must be one of {', '.join(MODES)}, not {requested!r}")
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        if not _NAME.fullmatch(name_prefix + "0"):
            raise ValueError(f"bad shared-memory name prefix {name_prefix!r}")
        self.requested = requested
        self.mode = requested
        self.fallback_reason: str | None = None
        self.max_inflight = max_inflight
        self.name_prefix = name_prefix
        self._tag = f"{name_prefix}{os.getpid()}_{secrets.token_hex(3)}_"
        self._seq = 0
        # Ack ids start at random: a restarted sender never mistakes the ack of its predecessor's handle.
        self._next_id = secrets.randbelow(1 << 61) + 1
        self._shm: dict[int, tuple[str, int]] = {}  # id -> (segment name, bytes)
        self._ipc: dict[int, tuple[Any, CudaIpcStorage, int]] = {}  # id -> (device tensor, export, bytes)
        self._chunks: dict[int, tuple[PoolChunk, Any]] = {}  # id -> (chunk, what lives until the ack)
        self._sent = {"shm": 0, "cuda_ipc": 0, "pool": 0}
        self._fallbacks = {"pool_full": 0, "ipc_full": 0}
        self._stale = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, shm.unlink_all, self._shm)  # also at interpreter exit
        if sweep:
            shm.sweep_orphans(name_prefix)
        self._backend: Any = None
        self._pool: Any = None
        self._pool_export: CudaIpcStorage | None = None
        self._alloc: PoolAllocator | None = None
        self.pool_id = 0
        if requested != "default":
            self._backend = backend if backend is not None else cuda_backend(device)
            if self._backend is None:
                self._fall_back("default", "CUDA is not available")
        if self.mode == "cuda_ipc_pool":
            try:
                self._pool = self._backend.alloc_pool(pool_size_mb * MIB)
                self._pool_export = self._backend.export(self._pool)
            except Exception as e:  # out of device memory, or the export failed
                self._pool = None
                self._fall_back("cuda_ipc", f"could not allocate and export the {pool_size_mb} MiB pool: {e}")
            else:
                self._alloc = PoolAllocator(pool_size_mb * MIB)
                self.pool_id = secrets.randbelow(1 << 61) + 1

    def _fall_back(self, mode: str, reason: str) -> None:
        logger.warning("tensor transport: %s unavailable (%s); using %s", self.mode, reason, mode)
        self.mode, self.fallback_reason = mode, reason

    def send(self, x: Any) -> TensorHandle:
        """A handle to a copy of `x` (a numpy array or a torch tensor; the caller may reuse `x` at once).
        Raises TransportFull when even shared memory has `max_inflight` segments unacknowledged."""
        if self._closed:
            raise TransportError("the tensor sender is closed")
        src, shape, dtype, nbytes = _source(x)
        hid = self._next_id
        self._next_id += 1
        if nbytes == 0:
            return ShmTensor(hid, "", shape, dtype, 0)
        if self.mode == "cuda_ipc_pool":
            handle = self._send_pool(hid, src, shape, dtype, nbytes)
            if handle is not None:
                return handle
            self._fallbacks["pool_full"] += 1
        if self.mode != "default":
            if len(self._ipc) < self.max_inflight:
                return self._send_ipc(hid, src, shape, dtype, nbytes)
            self._fallbacks["ipc_full"] += 1
        return self._send_shm(hid, src, shape, dtype, nbytes)

    def _send_pool(self, hid: int, src: Any, shape: tuple[int, ...], dtype: str, nbytes: int) -> PoolTensor | None:
        assert self._alloc is not None and self._pool_export is not None
        if len(self._chunks) >= self.max_inflight:
            return None
        chunk = self._alloc.allocate(nbytes)
        if chunk is None:
            return None
        try:
            keep, event_handle = self._backend.write(self._pool, chunk.offset, src, nbytes)
        except BaseException:
            self._alloc.free(chunk.offset, chunk.generation)
            raise
        self._chunks[hid] = (chunk, keep)
        self._sent["pool"] += 1
        return PoolTensor(hid, self.pool_id, self._pool_export, chunk.offset, nbytes, chunk.generation, shape, dtype,
                          event_handle)

    def _send_ipc(self, hid: int, src: Any, shape: tuple[int, ...], dtype: str, nbytes: int) -> CudaIpcTensor:
        t = self._backend.upload(src)
        export = self._backend.export(t)
        self._ipc[hid] = (t, export, nbytes)
        self._sent["cuda_ipc"] += 1
        return CudaIpcTensor(hid, export, shape, dtype, nbytes)

    def _send_shm(self, hid: int, src: Any, shape: tuple[int, ...], dtype: str, nbytes: int) -> ShmTensor:
        if len(self._shm) >= self.max_inflight:
            self._sweep()
            if len(self._shm) >= self.max_inflight:
                raise TransportFull(f"{len(self._shm)} shared-memory segments are waiting for the scheduler")
        flat = _host_bytes(src)
        self._seq += 1
        name = f"{self._tag}{self._seq}"
        seg = shm.create(name, nbytes)
        self._shm[hid] = (name, nbytes)
        try:
            dst = np.ndarray((nbytes,), np.uint8, buffer=seg.buf)
            dst[:] = flat
            del dst
        except BaseException:
            del self._shm[hid]
            shm.unlink(name)
            raise
        finally:
            seg.close()
        self._sent["shm"] += 1
        return ShmTensor(hid, name, shape, dtype, nbytes)

    def _sweep(self) -> None:
        """Forget the segments the receiver unlinked without an ack reaching us."""
        for hid in [h for h, (name, _) in self._shm.items() if not shm.exists(name)]:
            del self._shm[hid]

    def on_ack(self, ack: TransportAck) -> None:
        """The receiver finished copying these handles: release their segments, tensors and chunks."""
        for hid in ack.ids:
            if self._shm.pop(hid, None) is not None or self._ipc.pop(hid, None) is not None:
                continue  # the receiver unlinked the segment; a dropped tensor returns its block
            rec = self._chunks.pop(hid, None)
            if rec is None or self._alloc is None or not self._alloc.free(rec[0].offset, rec[0].generation):
                self._stale += 1

    def reset(self) -> None:
        """The receiver is gone (the scheduler restarted): release everything in flight. A handle still
        queued for the new receiver then fails to receive (its request was failed with the old one)."""
        shm.unlink_all(self._shm)
        for _, export, _ in self._ipc.values():
            with contextlib.suppress(Exception):
                self._backend.release_counter(export)  # or torch keeps the block in limbo for ever
        self._ipc.clear()
        if self._alloc is not None:
            for chunk, _ in self._chunks.values():
                self._alloc.free(chunk.offset, chunk.generation)
        self._chunks.clear()

    def close(self) -> None:
        """Unlink every unacknowledged segment and drop every device tensor (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._ipc.clear()
        self._chunks.clear()
        self._pool = self._pool_export = self._alloc = None

    def __enter__(self) -> TensorSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> SenderStats:
        return SenderStats(
            mode=self.mode,
            live_segments=len(self._shm),
            segment_bytes=sum(n for _, n in self._shm.values()),
            ipc_inflight=len(self._ipc),
            ipc_bytes=sum(n for _, _, n in self._ipc.values()),
            pool_size=self._alloc.size if self._alloc is not None else 0,
            pool_bytes_in_use=self._alloc.bytes_in_use if self._alloc is not None else 0,
            pool_chunks=len(self._chunks),
            sent=dict(self._sent),
            fallbacks=dict(self._fallbacks),
            stale_acks=self._stale,
        )


# ---- receiver -------------------------------------------------------------------------------------------
class _Pending:
    """A copy out of the sender's memory, enqueued: `keep` (the mapped source, the sender's event) lives
    until `done` has completed; then `id` is acknowledged."""

    __slots__ = ("id", "done", "keep", "device")

    def __init__(self, hid: int, done: Any, keep: Any, device: int) -> None:
        self.id, self.done, self.keep, self.device = hid, done, keep, device


class TensorReceiver:
    """Lives in the scheduler worker. `receive` returns a tensor the receiver owns; `pending_acks` returns
    the ids whose copies have completed (send it to the tokenizer at the end of each loop iteration).

    Workspaces of `cuda_ipc_pool` stay mapped per pool id, the `max_pools` most recently used (one per
    live tokenizer worker; a restarted one brings a new pool id, and the dead one's mapping is dropped)."""

    def __init__(self, *, max_pools: int = 1, backend: Any = None) -> None:
        self.max_pools = max(1, max_pools)
        self._backend = backend
        self._pools: OrderedDict[int, Any] = OrderedDict()  # pool id -> uint8 tensor over the workspace
        self._pending: list[_Pending] = []
        self._ready: list[int] = []

    def _cuda(self) -> Any:
        if self._backend is None:
            self._backend = cuda_backend(None)
            if self._backend is None:
                raise TransportError("a CUDA tensor handle arrived but this process has no CUDA")
        return self._backend

    def receive(self, handle: TensorHandle, device: Any) -> Any:
        """The handle's tensor, copied onto `device` (a torch.device or its name). On a CUDA device the
        caller's current stream is ordered after the copy; the sender's memory is released (and the id
        acknowledged) once the copy has completed."""
        _check_layout(handle.shape, handle.dtype, handle.nbytes)
        dtype = _torch_dtype(handle.dtype)
        if isinstance(handle, ShmTensor):
            return self._receive_shm(handle, dtype, device)
        backend = self._cuda()
        if isinstance(handle, CudaIpcTensor):
            s = handle.storage
            if handle.nbytes > s.size_bytes:
                raise TransportError(f"{handle.nbytes} bytes do not fit the exported storage of {s.size_bytes}")
            src, wait = backend.open_storage(s)
            waits = [wait] if wait is not None else []
            keep: tuple[Any, ...] = (src, wait)
        elif isinstance(handle, PoolTensor):
            pool, waits = self._open_pool(handle)
            if handle.offset < 0 or handle.offset + handle.nbytes > pool.numel():
                raise TransportError(f"chunk [{handle.offset}, +{handle.nbytes}) is outside pool {handle.pool_id}")
            waits.append(backend.open_event(handle.pool.device, handle.event_handle))
            src = pool[handle.offset:handle.offset + handle.nbytes]
            keep = (src, tuple(waits))
            s = handle.pool
        else:
            raise TransportError(f"not a tensor handle: {type(handle).__name__}")
        typed = src[:handle.nbytes].view(dtype).view(handle.shape)
        out, done = backend.copy_out(typed, waits, device)
        del typed, src, waits
        pending = _Pending(handle.id, done, keep, s.device)
        if done is None:
            self._finish(pending)
        else:
            self._pending.append(pending)
        return out

    def _open_pool(self, h: PoolTensor) -> tuple[Any, list[Any]]:
        pool = self._pools.get(h.pool_id)
        if pool is not None:
            self._pools.move_to_end(h.pool_id)
            return pool, []
        pool, wait = self._backend.open_storage(h.pool)
        self._pools[h.pool_id] = pool
        while len(self._pools) > self.max_pools:
            _, old = self._pools.popitem(last=False)
            with self._backend.releasing(old.device.index):
                del old  # pending copies from it hold views: the mapping goes with the last of them
        return pool, [wait] if wait is not None else []

    def _receive_shm(self, h: ShmTensor, dtype: Any, device: Any) -> Any:
        import torch

        if not h.name:
            return torch.empty(h.shape, dtype=dtype, device=device)
        if not _NAME.fullmatch(h.name):
            raise TransportError(f"bad shared-memory segment name {h.name!r}")
        try:
            seg = shm.attach(h.name)
        except FileNotFoundError as e:
            raise TransportError(f"shared-memory segment {h.name} is gone (its sender closed or reset)") from e
        try:
            if seg.size < h.nbytes:
                raise TransportError(f"shared-memory segment {h.name} holds {seg.size} bytes, not {h.nbytes}")
            assert seg.buf is not None  # an attached segment is mapped
            return self._copy_from_buffer(seg.buf, h, dtype, device)
        finally:
            with contextlib.suppress(BufferError):  # a view held by a failed copy's traceback
                seg.close()
            shm.unlink(h.name)  # whatever happened, this receiver was the segment's last user
            self._ready.append(h.id)

    def _copy_from_buffer(self, buf: memoryview, h: ShmTensor, dtype: Any, device: Any) -> Any:
        """A tensor of the receiver's own with the buffer's first h.nbytes bytes, its copy finished before
        the segment is unmapped."""
        import torch

        src = torch.frombuffer(buf, dtype=torch.uint8, count=h.nbytes).view(dtype).view(h.shape)
        dev = torch.device(device)
        if dev.type == "cpu":
            return src.clone()
        if dev.type == "cuda":
            return self._cuda().from_host(src, dev)
        return src.to(dev)

    def _finish(self, p: _Pending) -> None:
        with self._backend.releasing(p.device):
            p.keep = None
        self._ready.append(p.id)

    def pending_acks(self) -> TransportAck | None:
        """The ids whose copies have completed since the last call (never one only enqueued), or None."""
        if self._pending:
            running = []
            for p in self._pending:
                if self._backend.query(p.done):
                    self._finish(p)
                else:
                    running.append(p)
            self._pending = running
        if not self._ready:
            return None
        ids, self._ready = self._ready, []
        return TransportAck(ids)

    @property
    def in_flight(self) -> int:
        """Copies enqueued and not yet known to have completed."""
        return len(self._pending)

    @property
    def pools(self) -> int:
        return len(self._pools)

    def close(self) -> None:
        """Wait for the copies in flight and drop every mapping (their acks stay for pending_acks)."""
        for p in self._pending:
            self._backend.synchronize(p.done)
            self._finish(p)
        self._pending = []
        while self._pools:
            _, pool = self._pools.popitem()
            with self._backend.releasing(pool.device.index):
                del pool
