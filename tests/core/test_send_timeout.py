"""server.send_timeout: a response whose client reads none of it is cut once its writes have waited that
long (the handler sees a disconnect, so the request stops generating); a client that reads is not."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from mllmd.daemon.http_server import ConnectionGuard, connection_caps, protocol_class

CHUNK = b"x" * 65536


class StreamingApp:
    """Streams `total` bytes (None: for ever) and records whether it saw the client leave."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.disconnected = threading.Event()
        self.finished = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        sent = 0
        watcher = asyncio.ensure_future(receive())  # http.request, then http.disconnect when the client goes
        try:
            while self.total is None or sent < self.total:
                if watcher.done():
                    if watcher.result()["type"] == "http.disconnect":
                        self.disconnected.set()
                        return
                    watcher = asyncio.ensure_future(receive())
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
                sent += len(CHUNK)
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b""})
        finally:
            watcher.cancel()
            self.finished.set()


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[uvicorn.Server] = []

    def start(app: StreamingApp, send_timeout: float) -> tuple[int, ConnectionGuard]:
        guard = ConnectionGuard(connection_caps(16, 4, 1024), header_timeout=10.0, max_header_bytes=65536,
                                body_timeout=10.0, send_timeout=send_timeout)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(app, http=protocol_class(guard), lifespan="off", log_level="warning", log_config=None)
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        servers.append(server)
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return sock.getsockname()[1], guard

    yield start
    for s in servers:
        s.should_exit = True


def _request(port: int, rcvbuf: int | None = None) -> socket.socket:
    c = socket.socket()
    if rcvbuf is not None:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    c.connect(("127.0.0.1", port))
    c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return c


def test_a_client_that_reads_nothing_is_cut_and_its_handler_sees_it_leave(serve: Any) -> None:
    app = StreamingApp(total=None)  # an endless stream: only the cut ends it
    port, guard = serve(app, send_timeout=0.3)
    client = _request(port, rcvbuf=4096)
    try:
        assert app.disconnected.wait(60), "the stream was never cut"
        assert app.finished.wait(60)
        assert guard.send_timed_out == 1
        assert guard.stats()["send_timeouts"] == 1
        client.settimeout(30)
        while client.recv(1 << 20):  # what the kernel had buffered, then the end: closed (else a timeout)
            pass
    finally:
        client.close()


def test_a_client_that_reads_gets_the_whole_response(serve: Any) -> None:
    total = 64 * len(CHUNK)  # 4 MiB: more than the socket buffers, so writes pause and resume
    app = StreamingApp(total=total)
    port, guard = serve(app, send_timeout=5.0)
    client = _request(port, rcvbuf=4096)
    client.settimeout(60)
    got = 0
    try:
        while True:
            data = client.recv(1 << 16)
            got += len(data)
            if not data or data.endswith(b"0\r\n\r\n"):  # the chunked body's end
                break
    finally:
        client.close()
    assert got > total
    assert app.finished.wait(30) and not app.disconnected.is_set()
    assert guard.send_timed_out == 0
