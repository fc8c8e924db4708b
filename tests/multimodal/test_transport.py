"""Tensor transport (mllmd.multimodal.transport): bit-exact round trips through another process, no
shared-memory segment or resource-tracker warning left behind, the pool allocator, the ack protocol of
the CUDA modes on a CPU fake of the device, fallbacks and mode resolution. `gpu` tests: the CUDA modes
for real, across two processes."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import select
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from mllmd.messages import (
    CudaIpcStorage,
    CudaIpcTensor,
    PoolTensor,
    ShmTensor,
    TensorHandle,
    TokenizerInbox,
    TransportAck,
    decoder,
    encode,
)
from mllmd.multimodal import shm, transport, transport_probe
from mllmd.multimodal.pool_allocator import POOL_ALIGNMENT, PoolAllocator
from mllmd.multimodal.shm import segments as shm_segments
from mllmd.multimodal.shm import sweep_orphans
from mllmd.multimodal.transport import TensorReceiver, TensorSender, TransportError, TransportFull
from mllmd.multimodal.transport_probe import probe_cuda_ipc, resolve_mode
from tests.multimodal.transport_peer import digest, rss, tensor_digest

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("transport_peer.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
HAS_CUDA = torch.cuda.is_available()
_handle = msgspec.msgpack.Decoder(TensorHandle)
_names = itertools.count()


def source_digest(x: np.ndarray | torch.Tensor) -> str:
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("="), copy=False)
        return digest(tuple(x.shape), a.dtype.name, a.tobytes())
    return tensor_digest(x)


def samples() -> list[np.ndarray | torch.Tensor]:
    """Images and odd cases: odd sizes, one byte, a 0-d array, non-contiguous and big-endian arrays,
    bfloat16 and bool tensors, and zero-size arrays (which need no segment)."""
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 256, (3, 224, 224), dtype=np.uint8),
        rng.integers(0, 256, (3, 97, 131), dtype=np.uint8),
        rng.integers(0, 256, (1,), dtype=np.uint8),
        np.array(3.25),
        rng.standard_normal((5, 7)).astype(np.float32)[:, ::2],
        np.arange(12, dtype=">i4").reshape(3, 4),
        rng.integers(0, 2, (9,)).astype(bool),
        torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
        torch.arange(10, dtype=torch.int64),
        np.zeros((4, 0, 3), np.uint8),
        torch.zeros(0, 5),
    ]


def nbytes(x: np.ndarray | torch.Tensor) -> int:
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


class Peer:
    """transport_peer.py in a child process (see its docstring for the commands)."""

    def __init__(self, tmp: Path, name: str = "peer") -> None:
        self.err = tmp / f"{name}.stderr"
        self.held: bool | None = None  # the last recv's: was its GPU delay still running after the first poll
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=ENV)

    def _read(self, n: int, timeout: float) -> bytes:
        fd, buf = self.proc.stdout.fileno(), b""
        while len(buf) < n:
            if not select.select([fd], [], [], timeout)[0]:
                raise AssertionError(f"the peer did not answer in {timeout} s: {self.stderr()}")
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise AssertionError(f"the peer exited: {self.stderr()}")
            buf += chunk
        return buf

    def call(self, *msg, timeout: float = 120.0) -> list:
        data = msgspec.msgpack.encode(list(msg))
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()
        (n,) = struct.unpack("<I", self._read(4, timeout))
        reply = msgspec.msgpack.decode(self._read(n, timeout))
        assert reply[0] == "ok", reply[1]
        return reply[1:]

    def recv(self, handle: TensorHandle, device: str = "cpu", delay: int = 0) -> tuple[str, list[int], list[int]]:
        d, early, late, self.held = self.call("recv", msgspec.msgpack.encode(handle), device, delay)
        return d, early, late

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def exit(self, timeout: float = 60.0) -> str:
        data = msgspec.msgpack.encode(["exit"])
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.close()
        assert self.proc.wait(timeout) == 0, self.stderr()
        return self.stderr()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory):
    p = Peer(tmp_path_factory.mktemp("peer"))
    yield p
    p.exit()


@pytest.fixture
def prefix():
    """A segment-name prefix of this test's own; nothing with it may be left when the test ends."""
    name = f"mllmdt{os.getpid()}x{next(_names)}_"
    yield name
    left = shm_segments(name)
    for seg in left:
        shm.unlink(seg)
    assert not left, f"segments left behind: {left}"


def assert_clean_stderr(text: str) -> None:
    for word in ("resource_tracker", "leaked", "Traceback", "Warning", "KeyError"):
        assert word not in text, text


# ---- messages ----------------------------------------------------------------------------------------
def test_handles_decode_as_one_union_and_ack_reaches_the_tokenizer():
    storage = CudaIpcStorage(0, b"h" * 64, 4096, 512, b"/torch_1_2", 7, b"e" * 64, True)
    handles = [
        ShmTensor(1, "mllmd_1_ab_1", (3, 4, 5), "uint8", 60),
        CudaIpcTensor(2, storage, (2, 3), "bfloat16", 12),
        PoolTensor(3, 99, storage, 256, 60, 5, (3, 4, 5), "uint8", b"f" * 64),
    ]
    dec = msgspec.msgpack.Decoder(TensorHandle)
    for h in handles:
        assert dec.decode(msgspec.msgpack.encode(h)) == h
    assert decoder(TokenizerInbox).decode(encode(TransportAck([1, 2]))) == TransportAck([1, 2])


# ---- default mode, across processes ---------------------------------------------------------------
def test_default_round_trips_bit_exact_in_another_process(peer, prefix):
    with TensorSender("default", name_prefix=prefix) as sender:
        assert sender.mode == "default" and sender.fallback_reason is None
        for x in samples():
            h = sender.send(x)
            assert isinstance(h, ShmTensor) and h.nbytes == nbytes(x)
            assert bool(h.name) == (h.nbytes > 0)  # a zero-size tensor needs no segment
            assert len(shm_segments(prefix)) == (h.nbytes > 0)
            got, early, late = peer.recv(h)
            assert got == source_digest(x)
            assert shm_segments(prefix) == []  # the receiver unlinked it
            assert early == ([h.id] if h.nbytes else []) and late == []
            sender.on_ack(TransportAck(early))
        st = sender.stats()
        assert (st.live_segments, st.segment_bytes, st.stale_acks) == (0, 0, 0)
        assert st.sent["shm"] == sum(nbytes(x) > 0 for x in samples())


def test_sender_close_unlinks_what_was_never_received(prefix):
    sender = TensorSender("default", name_prefix=prefix)
    handles = [sender.send(np.full((3, 8, 8), i, np.uint8)) for i in range(5)]
    assert len(shm_segments(prefix)) == 5 and sender.stats().live_segments == 5
    sender.close()
    assert shm_segments(prefix) == []
    sender.close()  # idempotent
    with pytest.raises(TransportError, match="gone"):
        TensorReceiver().receive(handles[0], "cpu")
    with pytest.raises(TransportError, match="closed"):
        sender.send(np.zeros(3, np.uint8))


def test_killed_receiver_leaves_nothing_once_the_sender_closes(tmp_path, prefix):
    victim = Peer(tmp_path, "victim")
    sender = TensorSender("default", name_prefix=prefix)
    try:
        x = np.arange(300, dtype=np.uint8)
        got, early, _ = victim.recv(sender.send(x))
        assert got == source_digest(x)
        sender.on_ack(TransportAck(early))
        for i in range(3):  # sent, never read: the receiver dies with them queued
            sender.send(np.full(1000 + i, i, np.uint8))
        assert len(shm_segments(prefix)) == 3
        victim.kill()
        assert len(shm_segments(prefix)) == 3
    finally:
        sender.close()
    assert shm_segments(prefix) == []


def test_reset_forgets_what_a_dead_receiver_held(prefix):
    sender = TensorSender("default", name_prefix=prefix)
    hs = [sender.send(np.ones(64, np.uint8)) for _ in range(3)]
    sender.reset()
    assert shm_segments(prefix) == [] and sender.stats().live_segments == 0
    sender.on_ack(TransportAck([h.id for h in hs]))  # a late ack from the dead receiver frees nothing
    assert sender.stats().stale_acks == 3
    x = np.arange(10, dtype=np.uint8)
    assert TensorReceiver().receive(sender.send(x), "cpu").numpy().tobytes() == x.tobytes()
    sender.close()


def test_no_resource_tracker_warning_on_either_side(tmp_path, prefix):
    """Sender and receiver are both children, so that their exit (where trackers complain) is seen."""
    sender, receiver = Peer(tmp_path, "sender"), Peer(tmp_path, "receiver")
    try:
        xs = [np.random.default_rng(i).integers(0, 256, (3, 33 + i, 17), dtype=np.uint8) for i in range(3)]
        hs = [_handle.decode(sender.call("send", "default", prefix, x.tobytes(), list(x.shape), "uint8")[0]) for x in xs]
        assert len(shm_segments(prefix)) == 3
        for x, h in zip(xs[:2], hs[:2]):
            got, early, _ = receiver.recv(h)
            assert got == source_digest(x)
            sender.call("ack", early)
        assert len(shm_segments(prefix)) == 1  # the third was never received ...
        err_receiver = receiver.exit()
        err_sender = sender.exit()  # ... and the sender exits without close(): its finalizer unlinks it
    finally:
        for p in (sender, receiver):
            if p.proc.poll() is None:
                p.kill()
    assert shm_segments(prefix) == []
    assert_clean_stderr(err_receiver)
    assert_clean_stderr(err_sender)


def test_orphans_of_dead_senders_are_swept(prefix):
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan, alive = f"{prefix}{dead.pid}_aa_1", f"{prefix}{os.getppid()}_bb_1"
    for name in (orphan, alive):
        shm.create(name, 16).close()
    assert sweep_orphans(prefix) == [orphan]
    assert shm_segments(prefix) == [alive]
    shm.unlink(alive)


def test_unacknowledged_segments_are_bounded(prefix):
    sender = TensorSender("default", name_prefix=prefix, max_inflight=3)
    receiver = TensorReceiver()
    hs = [sender.send(np.full(10, i, np.uint8)) for i in range(3)]
    with pytest.raises(TransportFull):
        sender.send(np.zeros(10, np.uint8))
    receiver.receive(hs[0], "cpu")  # unlinked; its ack lost (a dead scheduler, say)
    h = sender.send(np.zeros(10, np.uint8))  # the sweep notices the segment is gone
    assert sender.stats().live_segments == 3
    for x in (hs[1], hs[2], h):
        receiver.receive(x, "cpu")
    sender.on_ack(receiver.pending_acks())
    assert sender.stats().live_segments == 0
    assert sender.stats().stale_acks == 1  # hs[0], already forgotten by the sweep
    sender.close()


def test_receiver_refuses_malformed_handles(prefix):
    receiver = TensorReceiver()
    with TensorSender("default", name_prefix=prefix) as sender:
        h = sender.send(np.zeros(16, np.uint8))
        for bad in (msgspec.structs.replace(h, nbytes=17), msgspec.structs.replace(h, dtype="complex64"),
                    msgspec.structs.replace(h, name="../etc/passwd")):
            with pytest.raises(TransportError):
                receiver.receive(bad, "cpu")
        assert len(shm_segments(prefix)) == 1  # refused before the segment was touched
        with pytest.raises(TransportError, match="holds 16 bytes, not 32"):
            receiver.receive(msgspec.structs.replace(h, shape=(4, 8), nbytes=32), "cpu")
        assert shm_segments(prefix) == []  # opened, then unlinked: nobody else would
    with pytest.raises(TypeError):
        TensorSender("default", name_prefix=prefix).send(np.zeros(3, np.complex64))


def test_default_soak_of_1000_images(peer, prefix):
    """1,000 images of varied sizes, in batches of 8 in flight: every one bit-exact, no segment left,
    the registry empty, neither process's RSS growing after the first 100."""
    rng = np.random.default_rng(7)
    sizes = [(3, 224, 224), (3, 97, 131), (3, 320, 240), (3, 63, 65)]
    base = {}
    with TensorSender("default", name_prefix=prefix) as sender:
        for start in range(0, 1000, 8):
            batch = [rng.integers(0, 256, sizes[(start + i) % 4], dtype=np.uint8) for i in range(8)]
            handles = [sender.send(x) for x in batch]
            assert sender.stats().live_segments == 8
            for x, h in zip(batch, handles):
                got, early, _ = peer.recv(h)
                assert got == source_digest(x)
                sender.on_ack(TransportAck(early))
            if start == 96:
                base = {"sender": rss(), "receiver": peer.call("mem")[0]}
        st = sender.stats()
        assert st.sent["shm"] == 1000 and st.live_segments == 0 and st.stale_acks == 0
        assert shm_segments(prefix) == []
        growth = {"sender": rss() - base["sender"], "receiver": peer.call("mem")[0] - base["receiver"]}
        assert all(g < 32 * transport.MIB for g in growth.values()), growth


# ---- mode resolution, fallbacks without CUDA, the probe -------------------------------------------------
def test_resolve_mode():
    assert resolve_mode("default", None) == ("default", None)
    assert resolve_mode("default", "CUDA is not available") == ("default", None)
    assert resolve_mode("cuda_ipc_pool", None) == ("cuda_ipc_pool", None)
    mode, line = resolve_mode("cuda_ipc", "Orin is an integrated GPU: legacy CUDA IPC is unsupported")
    assert mode == "default"
    assert "cuda_ipc" in line and "integrated GPU" in line and "using default" in line and "\n" not in line
    with pytest.raises(ValueError):
        resolve_mode("nccl", None)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback without CUDA")
@pytest.mark.parametrize("mode", ["cuda_ipc", "cuda_ipc_pool"])
def test_cuda_modes_without_cuda_fall_back_to_default(mode, prefix, caplog):
    with caplog.at_level(logging.WARNING, logger="mllmd.transport"):
        sender = TensorSender(mode, name_prefix=prefix)
    assert sender.mode == "default" and sender.requested == mode
    assert sender.fallback_reason == "CUDA is not available"
    assert [r.getMessage() for r in caplog.records] == [f"tensor transport: {mode} unavailable (CUDA is not available); using default"]
    x = np.arange(50, dtype=np.uint8)
    h = sender.send(x)
    assert isinstance(h, ShmTensor)
    assert TensorReceiver().receive(h, "cpu").numpy().tobytes() == x.tobytes()
    sender.close()


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer without CUDA")
def test_probe_without_cuda():
    assert probe_cuda_ipc("cuda:0", timeout=300) == "CUDA is not available"


def test_probe_does_not_try_on_tegra(tmp_path, monkeypatch):
    marker = tmp_path / "nv_tegra_release"
    marker.write_text("# R36 (release), REVISION: 4.0\n")
    monkeypatch.setattr(transport_probe, "TEGRA_MARKERS", (str(marker),))
    monkeypatch.setattr(transport_probe.subprocess, "run", lambda *a, **k: pytest.fail("the probe must not start a process"))
    reason = probe_cuda_ipc("cuda:0")
    assert "Tegra" in reason and "unsupported" in reason
    assert resolve_mode("cuda_ipc_pool", reason)[0] == "default"


def test_probe_reports_a_child_that_fails(monkeypatch):
    monkeypatch.setattr(transport_probe, "TEGRA_MARKERS", ())
    monkeypatch.setattr(transport_probe.sys, "executable", "/bin/false")
    assert probe_cuda_ipc("cuda:0", timeout=5).startswith("the CUDA IPC probe failed")


# ---- the pool allocator ----------------------------------------------------------------------------------
def test_allocator_best_fit_split_and_merge():
    a = PoolAllocator(4096, alignment=256)
    c = [a.allocate(n) for n in (256, 512, 256, 1024)]  # [0,256) [256,768) [768,1024) [1024,2048)
    assert [(x.offset, x.size) for x in c] == [(0, 256), (256, 512), (768, 256), (1024, 1024)]
    assert a.bytes_in_use == 2048 and a.free_ranges() == [(2048, 2048)]
    assert a.free(c[1].offset, c[1].generation) and a.free(c[3].offset, c[3].generation)
    assert a.free_ranges() == [(256, 512), (1024, 3072)]  # [1024,2048) merged with the tail
    small = a.allocate(300)  # best fit: the 512 hole, not the 3072 tail
    assert (small.offset, small.size) == (256, 512)
    assert a.free(small.offset, small.generation) and a.free(c[0].offset, c[0].generation)
    assert a.free(c[2].offset, c[2].generation)
    assert a.free_ranges() == [(0, 4096)] and a.bytes_in_use == 0 and a.live_chunks == 0
    assert a.allocate(4096).offset == 0 and a.allocate(1) is None  # full


def test_allocator_refuses_stale_and_double_frees():
    a = PoolAllocator(1024)
    first = a.allocate(100)
    assert a.free(first.offset, first.generation)
    again = a.allocate(100)  # same offset, next use
    assert again.offset == first.offset and again.generation != first.generation
    assert not a.free(first.offset, first.generation)  # a stale ack of the first use
    assert not a.free(again.offset + 256, again.generation)  # not an allocation's start
    assert a.bytes_in_use == 256
    assert a.free(again.offset, again.generation) and not a.free(again.offset, again.generation)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(ValueError):
        PoolAllocator(1024, alignment=100)
    assert PoolAllocator(1000, alignment=256).size == 768 and PoolAllocator(100).allocate(1) is None


def test_allocator_random_workload_never_overlaps_or_exceeds_the_pool():
    """Random allocations and frees over a bytearray standing in for the device memory: each live chunk
    keeps the pattern written into it, the bytes in use never pass the size, and all merges back."""
    rng = random.Random(3)
    a = PoolAllocator(64 * 1024, alignment=256)
    memory = bytearray(a.size)
    live: dict[int, tuple[object, int]] = {}
    for step in range(4000):
        if live and (rng.random() < 0.45 or a.free_ranges() == []):
            key = rng.choice(list(live))
            chunk, tag = live.pop(key)
            assert memory[chunk.offset:chunk.offset + chunk.size] == bytes([tag]) * chunk.size
            assert a.free(chunk.offset, chunk.generation)
        else:
            n = rng.choice([1, 255, 256, 257, 1000, 3000, 9000])
            chunk = a.allocate(n)
            if chunk is None:
                assert max((s for _, s in a.free_ranges()), default=0) < -(-n // 256) * 256
                continue
            assert chunk.offset % 256 == 0 and chunk.size >= n and chunk.offset + chunk.size <= a.size
            tag = step % 251 + 1
            memory[chunk.offset:chunk.offset + chunk.size] = bytes([tag]) * chunk.size
            live[step] = (chunk, tag)
        assert a.bytes_in_use == sum(c.size for c, _ in live.values()) <= a.size
        assert a.bytes_in_use + sum(s for _, s in a.free_ranges()) == a.size
    for chunk, _ in live.values():
        assert a.free(chunk.offset, chunk.generation)
    assert a.free_ranges() == [(0, a.size)]


# ---- the CUDA modes' protocol on a CPU fake of the device ------------------------------------------
class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done


class FakeCuda:
    """A CPU stand-in for CudaBackend, for sender and receiver in one process: device memory is CPU
    tensors under fake IPC handles (the receiver reads the sender's bytes, as through a mapping), and
    the receiver's copies are deferred until run(), as if enqueued on a busy stream."""

    def __init__(self) -> None:
        self.mem: dict[bytes, torch.Tensor] = {}
        self.events: dict[bytes, FakeEvent] = {}
        self.queue: list[tuple[torch.Tensor, torch.Tensor, FakeEvent]] = []
        self.opened: list[bytes] = []
        self.released: list[bytes] = []
        self._n = itertools.count()

    def _handle(self, kind: str) -> bytes:
        return f"{kind}{next(self._n)}".encode().ljust(64, b"\0")

    def _event(self) -> tuple[FakeEvent, bytes]:
        h = self._handle("ev")
        self.events[h] = FakeEvent(done=True)  # the sender's host-to-device copies are done on return
        return self.events[h], h

    @staticmethod
    def _tensor(src) -> torch.Tensor:
        return torch.from_numpy(src.copy()) if isinstance(src, np.ndarray) else src

    def upload(self, src) -> torch.Tensor:
        return self._tensor(src).clone()

    def export(self, t: torch.Tensor) -> CudaIpcStorage:
        h = self._handle("mem")
        self.mem[h] = t.reshape(-1).view(torch.uint8)
        _, ev = self._event()
        return CudaIpcStorage(0, h, t.numel() * t.element_size(), 0, b"/fake_rc", 0, ev, True)

    def alloc_pool(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8)

    def write(self, pool, offset, src, n):
        pool[offset:offset + n] = self._tensor(src).reshape(-1).view(torch.uint8)
        return self._event()

    def release_counter(self, storage: CudaIpcStorage) -> None:
        self.released.append(storage.handle)

    def open_storage(self, s: CudaIpcStorage):
        self.opened.append(s.handle)
        return self.mem[s.handle][s.offset_bytes:s.offset_bytes + s.size_bytes], self.events[s.event_handle]

    def open_event(self, index: int, handle: bytes) -> FakeEvent:
        return self.events[handle]

    def copy_out(self, src, waits, device):
        assert all(w.done for w in waits)
        out, done = torch.empty(src.shape, dtype=src.dtype), FakeEvent()
        self.queue.append((out, src, done))
        return out, done

    def run(self) -> None:
        for out, src, done in self.queue:
            out.copy_(src)
            done.done = True
        self.queue.clear()

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def synchronize(self, event: FakeEvent) -> None:
        self.run()

    def releasing(self, index: int):
        return contextlib.nullcontext()


def image(i: int, size: int = 3000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def test_pool_round_trip_acks_only_completed_copies(prefix):
    fake = FakeCuda()
    sender = TensorSender("cuda_ipc_pool", pool_size_mb=1, name_prefix=prefix, backend=fake)
    receiver = TensorReceiver(backend=fake)
    assert sender.mode == "cuda_ipc_pool" and sender.stats().pool_size == transport.MIB
    xs = [image(i) for i in range(3)] + [torch.randn(4, 6).to(torch.bfloat16)]
    hs = [sender.send(x) for x in xs]
    assert all(isinstance(h, PoolTensor) and h.pool_id == sender.pool_id for h in hs)
    assert len({h.offset for h in hs}) == 4 and all(h.offset % POOL_ALIGNMENT == 0 for h in hs)
    outs = [receiver.receive(h, "cpu") for h in hs]
    assert receiver.pending_acks() is None and receiver.in_flight == 4  # copies enqueued, not finished
    fake.run()
    ack = receiver.pending_acks()
    assert sorted(ack.ids) == sorted(h.id for h in hs) and receiver.pending_acks() is None
    for x, out in zip(xs, outs):
        assert tensor_digest(out) == source_digest(x)
    assert sender.stats().pool_bytes_in_use > 0
    sender.on_ack(ack)
    st = sender.stats()
    assert (st.pool_bytes_in_use, st.pool_chunks, st.stale_acks, st.sent["pool"]) == (0, 0, 0, 4)
    assert fake.opened.count(hs[0].pool.handle) == 1  # the workspace is mapped once, not per tensor
    sender.on_ack(ack)
    assert sender.stats().stale_acks == 4
    sender.close()


def test_an_ack_on_enqueue_would_let_the_sender_overwrite_the_chunk(prefix):
    """The race the event-ordered ack prevents, shown on the fake: acknowledging a copy that has only
    been enqueued lets the next send reuse the chunk before the copy reads it."""
    fake = FakeCuda()
    sender = TensorSender("cuda_ipc_pool", pool_size_mb=1, name_prefix=prefix, backend=fake)
    receiver = TensorReceiver(backend=fake)
    first, second = image(1, transport.MIB), image(2, transport.MIB)
    h1 = sender.send(first)
    out = receiver.receive(h1, "cpu")
    sender.on_ack(TransportAck([h1.id]))  # what pending_acks never does
    h2 = sender.send(second)
    assert isinstance(h2, PoolTensor) and (h2.offset, h2.generation) != (h1.offset, h1.generation)
    assert h2.offset == h1.offset
    fake.run()
    assert out.numpy().tobytes() == second.tobytes() != first.tobytes()
    sender.close()


def test_full_pool_falls_back_to_cuda_ipc_then_to_shared_memory(prefix):
    fake = FakeCuda()
    sender = TensorSender("cuda_ipc_pool", pool_size_mb=1, max_inflight=2, name_prefix=prefix, backend=fake)
    receiver = TensorReceiver(backend=fake)
    half = transport.MIB // 2
    xs = [image(i, half) for i in range(5)] + [image(9, 2 * transport.MIB)]
    hs = [sender.send(x) for x in xs]
    kinds = [type(h).__name__ for h in hs]
    # two chunks fill the pool; then two per-tensor IPC exports (max_inflight); then shared memory
    assert kinds == ["PoolTensor"] * 2 + ["CudaIpcTensor"] * 2 + ["ShmTensor"] * 2
    st = sender.stats()
    assert st.pool_bytes_in_use == transport.MIB <= st.pool_size and st.ipc_inflight == 2 and st.live_segments == 2
    assert st.fallbacks == {"pool_full": 4, "ipc_full": 2}
    with pytest.raises(TransportFull):  # shared memory, the last resort, is bounded too
        sender.send(xs[0])
    outs = [receiver.receive(h, "cpu") for h in hs]
    assert shm_segments(prefix) == []
    fake.run()
    for x, out in zip(xs, outs):
        assert tensor_digest(out) == source_digest(x)
    sender.on_ack(receiver.pending_acks())
    st = sender.stats()
    assert (st.pool_bytes_in_use, st.ipc_inflight, st.live_segments) == (0, 0, 0)
    assert isinstance(sender.send(xs[0]), PoolTensor)  # the chunks were recycled
    sender.close()


def test_cuda_ipc_keeps_each_tensor_until_its_ack(prefix):
    fake = FakeCuda()
    sender = TensorSender("cuda_ipc", name_prefix=prefix, backend=fake)
    receiver = TensorReceiver(backend=fake)
    xs = [image(i, 777) for i in range(3)] + [torch.arange(6, dtype=torch.int32).reshape(2, 3)]
    hs = [sender.send(x) for x in xs]
    assert all(isinstance(h, CudaIpcTensor) for h in hs) and sender.stats().ipc_inflight == 4
    outs = [receiver.receive(h, "cpu") for h in hs]
    assert receiver.pending_acks() is None and sender.stats().ipc_inflight == 4
    fake.run()
    sender.on_ack(receiver.pending_acks())
    assert sender.stats().ipc_inflight == 0
    assert [tensor_digest(o) for o in outs] == [source_digest(x) for x in xs]
    sender.close()


def test_reset_releases_chunks_and_torch_ipc_counters(prefix):
    fake = FakeCuda()
    sender = TensorSender("cuda_ipc_pool", pool_size_mb=1, name_prefix=prefix, backend=fake)
    big = sender.send(image(0, 2 * transport.MIB))  # does not fit the pool: cuda_ipc
    small = sender.send(image(1))
    assert isinstance(big, CudaIpcTensor) and isinstance(small, PoolTensor)
    sender.reset()
    st = sender.stats()
    assert (st.pool_bytes_in_use, st.ipc_inflight) == (0, 0)
    assert fake.released == [big.storage.handle]
    sender.close()


def test_receiver_keeps_one_mapping_per_pool_and_drops_a_dead_senders(prefix):
    fake = FakeCuda()
    receiver = TensorReceiver(backend=fake)
    old = TensorSender("cuda_ipc_pool", pool_size_mb=1, name_prefix=prefix, backend=fake)
    for i in range(3):
        receiver.receive(old.send(image(i)), "cpu")
    assert receiver.pools == 1 and len(fake.opened) == 1
    new = TensorSender("cuda_ipc_pool", pool_size_mb=1, name_prefix=prefix, backend=fake)  # a restarted tokenizer
    assert new.pool_id != old.pool_id
    x = image(5)
    out = receiver.receive(new.send(x), "cpu")
    assert receiver.pools == 1 and len(fake.opened) == 2
    receiver.close()  # waits for the copies in flight
    assert out.numpy().tobytes() == x.tobytes() and receiver.in_flight == 0
    assert len(receiver.pending_acks().ids) == 4
    old.close()
    new.close()


def test_receiver_without_cuda_refuses_cuda_handles():
    if HAS_CUDA:
        pytest.skip("checks the refusal without CUDA")
    storage = CudaIpcStorage(0, b"h" * 64, 16, 0, b"/torch_1_2", 0, b"e" * 64, True)
    with pytest.raises(TransportError, match="no CUDA"):
        TensorReceiver().receive(CudaIpcTensor(1, storage, (16,), "uint8", 16), "cpu")


# ---- GPU: the CUDA modes for real, across two processes (H200) ---------------------------------------
def gpu_samples() -> list[np.ndarray | torch.Tensor]:
    return samples() + [torch.randn(3, 64, 64, device="cuda").to(torch.bfloat16), torch.arange(1000, device="cuda")]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["default", "cuda_ipc", "cuda_ipc_pool"])
def test_gpu_round_trips_bit_exact(mode, peer, prefix):
    kind = {"default": ShmTensor, "cuda_ipc": CudaIpcTensor, "cuda_ipc_pool": PoolTensor}[mode]
    with TensorSender(mode, "cuda:0", pool_size_mb=64, name_prefix=prefix) as sender:
        assert sender.mode == mode, sender.fallback_reason
        for x in gpu_samples():
            h = sender.send(x)
            assert isinstance(h, kind if nbytes(x) else ShmTensor)
            got, early, late = peer.recv(h, "cuda:0")
            assert got == source_digest(x)
            if nbytes(x):
                assert h.id in early + late
            sender.on_ack(TransportAck(early + late))
        st = sender.stats()
        assert (st.pool_bytes_in_use, st.ipc_inflight, st.live_segments, st.stale_acks) == (0, 0, 0, 0)
        assert st.fallbacks == {"pool_full": 0, "ipc_full": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["cuda_ipc", "cuda_ipc_pool"])
def test_gpu_ack_waits_for_the_copy_to_finish(mode, peer, prefix):
    """The receiver's copy queued behind a GPU sleep: no ack until it has run. The verdict counts only
    when the sleep was demonstrably still running after the first poll (the peer records an event behind
    it); when it was not (a slow first mapping of the pool once outlasted ~0.5 s), the sleep is lengthened
    and the case is sent again, so no outcome depends on how fast the host is."""
    with TensorSender(mode, "cuda:0", pool_size_mb=64, name_prefix=prefix) as sender:
        x = image(3, 4 * transport.MIB)
        for delay in (1_000_000_000, 4_000_000_000, 16_000_000_000):  # GPU clock cycles: ~0.5, 2 and 8 s
            h = sender.send(x)
            got, early, late = peer.recv(h, "cuda:0", delay=delay)
            # one ack, early (polled at once) only where the sleep had ended before that poll
            assert got == source_digest(x) and early + late == [h.id]
            st = sender.stats()
            assert st.pool_bytes_in_use + st.ipc_bytes >= x.nbytes  # held until the ack arrives
            sender.on_ack(TransportAck(early + late))
            st = sender.stats()
            assert st.pool_bytes_in_use == 0 and st.ipc_inflight == 0
            if peer.held:  # the sleep outlasted the first poll: the copy behind it had not run, so no ack then
                assert early == [] and late == [h.id]
                break
        else:
            pytest.fail("the receiver's host never polled its acks while the GPU sleep was still running")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", ["cuda_ipc", "cuda_ipc_pool"])
def test_gpu_soak_of_1000_images(mode, peer, prefix):
    """1,000 images, 8 in flight: bit-exact, the pool never over its size, no growth of device memory
    (either process's allocations, the device's free memory) or RSS after the first 100, no segment."""
    rng = np.random.default_rng(11)
    sizes = [(3, 224, 224), (3, 97, 131), (3, 448, 336), (3, 63, 65)]
    pool_mb = 8
    base: dict[str, int] = {}
    most_in_use = 0
    with TensorSender(mode, "cuda:0", pool_size_mb=pool_mb, name_prefix=prefix) as sender:
        for start in range(0, 1000, 8):
            batch = [rng.integers(0, 256, sizes[(start + i) % 4], dtype=np.uint8) for i in range(8)]
            handles = []
            for x in batch:
                handles.append(sender.send(x))
                most_in_use = max(most_in_use, sender.stats().pool_bytes_in_use)
            acks: list[int] = []
            for x, h in zip(batch, handles):
                got, early, late = peer.recv(h, "cuda:0")
                assert got == source_digest(x)
                acks += early + late
            sender.on_ack(TransportAck(acks))
            if start == 96:
                torch.cuda.synchronize()
                _, p_alloc, p_reserved, free = peer.call("mem")
                base = dict(alloc=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                            peer_alloc=p_alloc, peer_reserved=p_reserved, free=free, rss=rss(),
                            peer_rss=peer.call("mem")[0])
        st = sender.stats()
        assert (st.pool_bytes_in_use, st.ipc_inflight, st.live_segments, st.stale_acks) == (0, 0, 0, 0)
        assert most_in_use <= pool_mb * transport.MIB
        assert sum(st.sent.values()) == 1000 and st.sent["shm"] == 0
        torch.cuda.synchronize()
        peer_rss, p_alloc, p_reserved, free = peer.call("mem")
        # slack: blocks freed while marked for another stream are counted until the allocator's next pass
        # (1,000 leaked images would be ~300 MiB)
        assert torch.cuda.memory_allocated() <= base["alloc"] + 16 * transport.MIB
        assert torch.cuda.memory_reserved() <= base["reserved"] + 64 * transport.MIB
        assert p_alloc <= base["peer_alloc"] + 16 * transport.MIB
        assert p_reserved <= base["peer_reserved"] + 64 * transport.MIB
        assert free >= base["free"] - 128 * transport.MIB
        assert rss() - base["rss"] < 64 * transport.MIB and peer_rss - base["peer_rss"] < 64 * transport.MIB
    assert shm_segments(prefix) == []
    assert len(shm_segments(f"torch_{os.getpid()}_")) <= 2  # torch's IPC ref-counter files: shared, not per tensor


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_full_pool_falls_back(peer, prefix):
    with TensorSender("cuda_ipc_pool", "cuda:0", pool_size_mb=1, max_inflight=2, name_prefix=prefix) as sender:
        half = transport.MIB // 2
        xs = [image(i, half) for i in range(5)] + [image(9, 2 * transport.MIB)]
        hs = [sender.send(x) for x in xs]
        assert [type(h).__name__ for h in hs] == ["PoolTensor"] * 2 + ["CudaIpcTensor"] * 2 + ["ShmTensor"] * 2
        assert sender.stats().fallbacks == {"pool_full": 4, "ipc_full": 2}
        acks: list[int] = []
        for x, h in zip(xs, hs):
            got, early, late = peer.recv(h, "cuda:0")
            assert got == source_digest(x)
            acks += early + late
        sender.on_ack(TransportAck(acks))
        st = sender.stats()
        assert (st.pool_bytes_in_use, st.ipc_inflight, st.live_segments) == (0, 0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_probe_finds_cuda_ipc_working():
    reason = probe_cuda_ipc("cuda:0")
    assert reason is None, reason
    assert resolve_mode("cuda_ipc_pool", reason) == ("cuda_ipc_pool", None)


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:1", "cpu"])
def test_a_cuda_mode_gets_a_cuda_device_whatever_runtime_device_says(vl_source, device, monkeypatch):
    """runtime.device "auto" (the default) reached TensorSender as torch.device("auto"), which raises:
    every CUDA mode crashed the tokenizer worker of a vision model on a GPU. The sender gets a CUDA
    device; with runtime.device cpu the mode falls back to default, saying why."""
    from mllmd.workers import vision_prompts

    probed, built = [], []

    class Sender:
        def __init__(self, mode, dev, pool_size_mb=0):
            built.append((mode, dev))
            self.mode, self.fallback_reason = mode, None

    monkeypatch.setattr(vision_prompts, "probe_cuda_ipc", lambda dev: probed.append(dev))  # None: it works
    monkeypatch.setattr(vision_prompts, "TensorSender", Sender)
    from mllmd.daemon.config import load_config

    server = load_config("/dev/null", {}).to_dict()["server"]
    vp = vision_prompts.VisionPrompts.start(str(vl_source), server, {"tensor_transport_mode": "cuda_ipc"}, device)
    if device == "cpu":
        assert probed == [] and built == [("default", None)]
        assert "runtime.device" in vp.sender.fallback_reason
    else:
        want = device if device.startswith("cuda") else "cuda:0"
        assert probed == [want] and built == [("cuda_ipc", want)]
