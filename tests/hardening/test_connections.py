"""Issue 35, items 5 and 6: connections that send nothing, send slowly, send huge headers, or are
simply too many — under a low open-file limit too. None of them reaches the app (or costs it a
descriptor it needs), the Unix socket stays reachable, and the log stays bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon.conftest import start_daemon, stop_and_check

from .helpers import log_lines, status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-connections-0123456789"
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
MAX_HEADER_BYTES = 16384


@pytest.fixture(scope="module")
def d(tiny_model: Path) -> Any:
    daemon = start_daemon(tiny_model, "--server.header_timeout", str(HEADER_TIMEOUT), "--server.max_header_bytes",
                          str(MAX_HEADER_BYTES), "--server.body_timeout", str(BODY_TIMEOUT), api_key=KEY)
    yield daemon
    stop_and_check(daemon)


def connect(d: Any, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", d.port), timeout=10) for _ in range(n)]


def closed_by_server(s: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing `s` (b"" for a plain close), or None if still open."""
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return data
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        return data


@contextlib.contextmanager
def trickled(socks: list[socket.socket], data: bytes) -> Iterator[None]:
    """Send `data` on every socket every 0.3 s (a slow client) while the block runs."""
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(data)
                except OSError:
                    pass
            time.sleep(0.3)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def health_ok(d: Any) -> bool:
    return httpx.get(d.base_url + "/health", timeout=10).status_code == 200


def test_slowloris_connections_are_closed(d: Any) -> None:
    """Before: no header timeout; a client sending its headers a byte at a time (or nothing at all) held
    its connection for ever. Now the headers must be complete within server.header_timeout."""
    silent = connect(d, 10)
    trickling = connect(d, 10)
    for s in trickling:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    with trickled(trickling, b"a"):
        assert health_ok(d)  # served meanwhile
        outcomes = [closed_by_server(s, 30 + HEADER_TIMEOUT) for s in silent + trickling]
    assert all(o is not None for o in outcomes), "a slow connection stayed open"
    assert all(o == b"" for o in outcomes[:10])  # nothing sent: closed without a word
    assert all(o.startswith(b"HTTP/1.1 408") for o in outcomes[10:] if o), outcomes[10:]  # type: ignore[union-attr]
    for s in silent + trickling:
        s.close()
    stats = status(d)["connections"]
    assert stats["header_timeouts"] >= 20, stats
    assert health_ok(d)


def test_a_dribbled_body_does_not_hold_its_connection(d: Any) -> None:
    """Before: headers sent in time, then a chunked body a byte every few seconds, held the connection
    for ever where the handler answered without reading the body (/health, a 401: uvicorn waits for the
    body's end, its keep-alive timer restarted by every byte), and after the 408 of one that did; 1,000
    such connections (3 KB/s) kept everyone else at 503. Now a response sent before the body ended
    closes the connection, and a body must end within server.body_timeout."""
    chunked = "Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n"
    heads = [
        f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{chunked}\r\n",
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{chunked}\r\n",  # no key: 401
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n{chunked}\r\n",
        f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n{chunked}\r\n",
    ]
    socks = connect(d, len(heads))
    for s, head in zip(socks, heads):
        s.sendall(head.encode() + b"1\r\n{\r\n")
    start = time.monotonic()
    with trickled(socks, b"1\r\n \r\n"):  # one-byte chunks
        outcomes = [closed_by_server(s, BODY_TIMEOUT + 15) for s in socks]
    took = time.monotonic() - start
    assert all(o is not None for o in outcomes), ("a dribbling connection stayed open", outcomes)
    statuses = [o.split(b"\r\n", 1)[0] for o in outcomes if o is not None]
    assert statuses[0].startswith(b"HTTP/1.1 200") and statuses[1].startswith(b"HTTP/1.1 401"), statuses
    assert statuses[2].startswith(b"HTTP/1.1 408"), statuses  # the handler's body deadline
    assert statuses[3].startswith(b"HTTP/1.1 408"), statuses
    assert took < BODY_TIMEOUT + 10, took
    for s in socks:
        s.close()
    assert health_ok(d)


def test_huge_headers_are_431_before_authentication(d: Any) -> None:
    """Before: a 64 MiB header got a 200 (no limit, before the API key was even looked at) and cost
    5.7 s of CPU and 122 MiB; four at once stalled /health for a second. Now anything past
    server.max_header_bytes is a 431 and the connection closes."""

    def huge(result: list[bytes | None]) -> None:
        s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            for _ in range(64):
                s.sendall(chunk)
        except OSError:
            pass  # the server closed it while we were still sending: fine
        result.append(closed_by_server(s, 30))
        s.close()

    results: list[bytes | None] = []
    threads = [threading.Thread(target=huge, args=(results,)) for _ in range(4)]
    for t in threads:
        t.start()
    assert health_ok(d)
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(r is not None for r in results)
    answered = [r for r in results if r]
    assert all(r.startswith(b"HTTP/1.1 431") and b"server.max_header_bytes" in r for r in answered), answered
    assert status(d)["connections"]["headers_too_large"] >= 4
    # within the limit: a normal answer (401 here: the header check comes first, then the key)
    r = httpx.get(d.base_url + "/v1/models", headers={"X-Pad": "p" * (MAX_HEADER_BYTES - 1024)}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(d.base_url + "/v1/models", headers={"X-Pad": "p" * (MAX_HEADER_BYTES + 10)}, timeout=10)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"


def test_file_descriptor_exhaustion_under_a_low_limit(tiny_model: Path) -> None:
    """Before, with the open-file limit reached by idle connections: the Unix socket was unreachable,
    asyncio logged the accept error 462,378 times (209 MiB) in 40 s, a worker lost meanwhile was never
    restarted (the supervisor loop died on Popen's OSError) and the daemon stayed "loading".
    Past the TCP cap (server.max_connections, lowered here by the open-file limit) each new connection
    is now answered 503 and closed at once.
    Now (ulimit -n 512, 600 idle connections, the detokenizer killed meanwhile): the Unix socket
    answers, the worker is restarted, /health answers within 5 s of the connections closing, and the
    log stays short."""
    d = start_daemon(tiny_model, "--server.header_timeout", "120", nofile=512)
    try:
        lines_before = len(log_lines(d))
        held = []
        for _ in range(600):
            try:
                held.append(socket.create_connection(("127.0.0.1", d.port), timeout=10))
            except OSError:
                break
        s = status(d)  # the Unix socket has room of its own
        assert s["state"] == "ready", s["state"]
        caps = s["connections"]["limits"]
        assert caps["tcp"] < 512 and s["connections"]["open"]["tcp"] <= caps["tcp"], s["connections"]
        # past the cap each new connection was answered 503 and closed at once
        assert s["connections"]["refused"] >= len(held) - caps["tcp"] - 5, s["connections"]
        answer = closed_by_server(held[-1], 30)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        old = d.workers()["detokenizer"]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while d.workers().get("detokenizer") in (None, old):
            assert time.monotonic() < deadline, f"the detokenizer was not restarted\n{d.log_tail()}"
            time.sleep(0.2)
        assert status(d)["connections"]["open"]["unix"] >= 1  # reachable all along
        for c in held:
            c.close()
        t0 = time.monotonic()
        while True:
            try:
                httpx.get(d.base_url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() - t0 < 5.0, "/health did not answer within 5 s of the connections closing"
                time.sleep(0.05)
        answered = time.monotonic() - t0
        d.wait_health(200, 120)
        lines = log_lines(d)[lines_before:]
        noisy = [ln for ln in lines if "accept" in ln or "Too many open files" in ln or "Traceback" in ln]
        print(f"fd exhaustion: {len(held)} connections held, caps {caps}; /health answered {answered:.2f} s after "
              f"they closed; {len(lines)} log lines meanwhile ({len(noisy)} about accept/EMFILE)")
        assert len(noisy) <= 5 and len(lines) < 100, "\n".join(lines[-40:])
    finally:
        stop_and_check(d)


# ---- the guard's settings, in process (a uvicorn server on a trivial app) ---------------------------
def test_guard_settings_do_what_they_say(tmp_path: Path) -> None:
    """server.max_connections, server.max_unix_connections, server.keepalive_timeout and the caps'
    arithmetic, on the daemon's own protocol class without a daemon."""
    import asyncio

    import uvicorn

    from mllmd.daemon.http_server import ConnectionGuard, connection_caps, protocol_class

    caps = connection_caps(3, 2, 20_000)
    assert (caps.tcp, caps.unix) == (3, 2)
    assert connection_caps(1000, 64, 512).tcp < 512 - 64  # the open-file limit wins
    guard = ConnectionGuard(caps, header_timeout=30.0, max_header_bytes=4096)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    uds = str(tmp_path / "g.sock")

    async def main() -> dict[str, Any]:
        tcp = socket.socket()
        tcp.bind(("127.0.0.1", 0))
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(uds)
        for sock in (tcp, unix):
            sock.listen(16)
            sock.setblocking(False)
        config = uvicorn.Config(app, http=protocol_class(guard), lifespan="off", log_level="warning",
                                timeout_keep_alive=0.5)  # type: ignore[arg-type]
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[tcp, unix]))
        while not server.started:
            await asyncio.sleep(0.01)
        port = tcp.getsockname()[1]
        out: dict[str, Any] = {}

        async def read_all(reader: asyncio.StreamReader) -> bytes:
            return await asyncio.wait_for(reader.read(), 10)

        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        await asyncio.sleep(0.2)
        out["tcp_refused"] = sum([b" 503 " in await read_all(r) for r, _ in conns[3:]])
        out["tcp_open"] = guard.open["tcp"]
        uconns = [await asyncio.open_unix_connection(uds) for _ in range(3)]
        out["unix_refused"] = (b" 503 " in await read_all(uconns[2][0]))
        out["unix_open"] = guard.open["unix"]
        # a held connection is served, then closed after keepalive_timeout of idleness
        r0, w0 = conns[0]
        w0.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        out["served"] = await asyncio.wait_for(r0.readuntil(b"ok"), 10)
        out["after_keepalive"] = await read_all(r0)  # EOF once the keep-alive timer fires
        for _, w in conns + uconns:
            w.close()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        return out

    out = asyncio.run(main())
    assert out["tcp_refused"] == 2 and out["tcp_open"] == 3, out
    assert out["unix_refused"] and out["unix_open"] == 2, out
    assert out["served"].startswith(b"HTTP/1.1 200") and out["after_keepalive"] == b"", out


def test_repeated_loop_errors_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio reports accept()'s EMFILE at every wake-up (462,378 lines in 40 s before): logged once,
    then at most once per 10 s with a count."""
    import logging

    from mllmd.daemon.main import _loop_exception

    caplog.set_level(logging.ERROR, logger="mllmd")
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    for _ in range(10_000):
        _loop_exception(None, context)  # type: ignore[arg-type]
    assert len([r for r in caplog.records if "accept" in r.getMessage()]) == 1
