"""The other process of the transport tests: a receiver (or a sender) driven over stdin/stdout.

Frames are a little-endian u32 length, then a msgpack array: the command and its arguments in, the
reply ("ok", ...) or ("error", text) out. The test side is `Peer` in test_transport.py.
    recv HANDLE DEVICE [DELAY]  receive (after DELAY GPU cycles queued on the copy stream, if > 0); reply
                                the tensor's digest, the acks ready at once, and the acks after a sync
    acks                        the acks ready now
    mem                         RSS bytes, CUDA bytes allocated / reserved, device bytes free (0 without CUDA)
    send MODE PREFIX RAW SHAPE DTYPE   (sender role) send these bytes; reply the encoded handle
    ack IDS / close             (sender role) TensorSender.on_ack / close
    exit                        leave normally (no reply; finalizers run)
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import traceback

import msgspec
import numpy as np
import torch

from mllmd.messages import TensorHandle, TransportAck
from mllmd.multimodal.transport import TensorReceiver, TensorSender

_handle = msgspec.msgpack.Decoder(TensorHandle)


def digest(shape: tuple[int, ...], dtype: str, raw: bytes) -> str:
    return hashlib.sha256(repr((tuple(shape), dtype)).encode() + raw).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return digest(tuple(t.shape), str(t.dtype).removeprefix("torch."), raw)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ids(ack: TransportAck | None) -> list[int]:
    return list(ack.ids) if ack is not None else []


class Peer:
    def __init__(self) -> None:
        self.receiver = TensorReceiver()
        self.sender: TensorSender | None = None

    def recv(self, data: bytes, device: str, delay: int = 0) -> list:
        """[digest, acks polled right after receive, acks once the copy has run, whether the delay (a GPU
        sleep queued before the copy) was still running when the first poll had been taken, or None]"""
        handle = _handle.decode(data)
        slept = None
        if delay:
            cs = self.receiver._cuda().stream(torch.device(device).index or 0)
            with torch.cuda.stream(cs):
                torch.cuda._sleep(delay)
                slept = torch.cuda.Event()
                slept.record(cs)
        t = self.receiver.receive(handle, device)
        early = _ids(self.receiver.pending_acks())
        held = None if slept is None else not slept.query()
        d = tensor_digest(t)  # a copy to the host: synchronises the current stream, ordered after the copy
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        del t
        return [d, early, _ids(self.receiver.pending_acks()), held]

    def mem(self) -> list:
        if not torch.cuda.is_available():
            return [rss(), 0, 0, 0]
        return [rss(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]]

    def send(self, mode: str, prefix: str, raw: bytes, shape: list[int], dtype: str) -> list:
        if self.sender is None:
            self.sender = TensorSender(mode, "cuda:0" if mode != "default" else None, name_prefix=prefix)
        arr = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)
        return [msgspec.msgpack.encode(self.sender.send(arr))]

    def handle(self, cmd: str, *args) -> list:
        if cmd == "recv":
            return self.recv(*args)
        if cmd == "acks":
            return [_ids(self.receiver.pending_acks())]
        if cmd == "mem":
            return self.mem()
        if cmd == "send":
            return self.send(*args)
        if cmd == "ack":
            assert self.sender is not None
            self.sender.on_ack(TransportAck(list(args[0])))
            return []
        if cmd == "close":
            assert self.sender is not None
            self.sender.close()
            return []
        raise ValueError(f"unknown command {cmd!r}")


def _read(n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sys.stdin.buffer.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def main() -> None:
    peer = Peer()
    out = sys.stdout.buffer
    while True:
        try:
            (n,) = struct.unpack("<I", _read(4))
            msg = msgspec.msgpack.decode(_read(n))
        except EOFError:
            return
        if msg[0] == "exit":
            return
        try:
            reply = ["ok", *peer.handle(*msg)]
        except Exception:
            reply = ["error", traceback.format_exc()]
        data = msgspec.msgpack.encode(reply)
        out.write(struct.pack("<I", len(data)) + data)
        out.flush()


if __name__ == "__main__":
    main()
