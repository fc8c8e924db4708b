"""Connection limits for the HTTP server: uvicorn's httptools protocol with a guard in front.

uvicorn alone has no header timeout, no header size limit (httptools keeps every byte of a header)
and no bound on idle connections, so a client could hold every file descriptor (and with it the Unix
socket, worker restarts and the log). The guard adds, per connection:

- a header deadline (`server.header_timeout`): from the connection's start, and from the first byte of
  each later request, the request line and headers must be complete in time, else 408 and close;
- a header size limit (`server.max_header_bytes`): more bytes before the end of the headers is a 431
  and close, before anything is parsed into memory or authenticated;
- connection counts, TCP and Unix socket apart (`server.max_connections`, `server.max_unix_connections`):
  past the limit a new connection is answered 503 and closed at once, so the admin socket always has
  room. The TCP limit never exceeds what the open-file limit leaves (see `connection_caps`);
- a body deadline (`server.body_timeout`): once the headers are in, the body must be complete in
  time, else the connection closes (a handler that reads the body answers 408 first). A handler that
  answers without reading the body (/health, a 401) would otherwise leave the connection waiting for
  the rest of a chunked body forever: uvicorn's keep-alive timer restarts with every byte;
- a response sent before its request's body ended closes the connection (after a lingering close):
  nothing more is wanted from it, and a client dribbling the body could otherwise hold it;
- a send deadline (`server.send_timeout`): a response whose client reads nothing while its data waits
  (the socket's buffers full: asyncio paused our writes) for that long is cut: the connection is aborted,
  its buffered output dropped, and the handler sees a disconnect, which stops the request's generation.
  A client that opened many streams and never reads them would otherwise keep the GPU generating their
  whole max_tokens and the main process holding their output for as long as it keeps the connections;
- idle keep-alive connections close after `server.keepalive_timeout` (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("mllmd.http")

LINGER = 2.0  # seconds a connection refused with an answer is drained before it is closed
FD_RESERVE = 96  # descriptors kept for the workers' pipes, ZMQ sockets, a hot swap's second slot, files


def raise_nofile_limit() -> int:
    """Raise the soft open-file limit to the hard one (as systemd's LimitNOFILE= would); returns the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True)
class ConnectionCaps:
    tcp: int
    unix: int
    backlog: int  # listen backlog, also how many connections asyncio accepts per wake-up
    nofile: int


def connection_caps(max_tcp: int, max_unix: int, nofile: int) -> ConnectionCaps:
    """Connection limits that fit the open-file limit `nofile`: a burst of accepts (the backlog), the
    Unix socket's share and FD_RESERVE stay free, so accept() and Popen() never meet EMFILE."""
    backlog = max(16, min(512, nofile // 8))
    unix = max(1, min(max_unix, nofile // 8))
    tcp = max(1, min(max_tcp, nofile - FD_RESERVE - backlog - unix))
    return ConnectionCaps(tcp, unix, backlog, nofile)


@dataclass
class ConnectionGuard:
    """Shared by every connection of one server: the limits and the live counts."""

    caps: ConnectionCaps
    header_timeout: float
    max_header_bytes: int
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    open: dict[str, int] = field(default_factory=lambda: {"tcp": 0, "unix": 0})
    refused: int = 0  # connections closed at once: over the limit
    timed_out: int = 0  # headers not complete within header_timeout
    too_large: int = 0  # headers over max_header_bytes
    body_timed_out: int = 0  # bodies not complete within body_timeout (+ LINGER)
    send_timed_out: int = 0  # responses cut: their client read nothing for send_timeout

    def limit(self, kind: str) -> int:
        return self.caps.unix if kind == "unix" else self.caps.tcp

    def stats(self) -> dict[str, Any]:
        return {"open": dict(self.open), "limits": {"tcp": self.caps.tcp, "unix": self.caps.unix},
                "refused": self.refused, "header_timeouts": self.timed_out, "headers_too_large": self.too_large,
                "body_timeouts": self.body_timed_out, "send_timeouts": self.send_timed_out}


def _response(status: int, phrase: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable_error", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {phrase}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def protocol_class(guard: ConnectionGuard) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, bound to `guard` (pass it as uvicorn.Config(http=...))."""
    too_many = {kind: _response(503, "Service Unavailable", f"too many open connections (the limit is "
                                f"{guard.limit(kind)}: server.max_{'unix_' if kind == 'unix' else ''}connections)",
                                "too_many_connections", retry_after=1) for kind in ("tcp", "unix")}
    too_large = _response(431, "Request Header Fields Too Large", f"the request line and headers exceed "
                          f"{guard.max_header_bytes} bytes (server.max_header_bytes)", "headers_too_large")
    too_slow = _response(408, "Request Timeout", f"the request headers did not arrive within "
                         f"{guard.header_timeout:g} s (server.header_timeout)", "request_timeout")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _kind = "tcp"
        _counted = False
        _closed_by_guard = False
        _headers_pending = True
        _header_bytes = 0
        _header_timer: asyncio.TimerHandle | None = None
        _body_pending = False
        _body_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._kind = "unix" if isinstance(transport.get_extra_info("sockname"), str) else "tcp"
            if guard.open[self._kind] >= guard.limit(self._kind):
                guard.refused += 1
                self.transport = transport
                self._closed_by_guard = True
                transport.write(too_many[self._kind])
                transport.close()
                return
            guard.open[self._kind] += 1
            self._counted = True
            super().connection_made(transport)
            self._start_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            self._cancel_body_timer()
            self._cancel_send_timer()
            if self._counted:
                guard.open[self._kind] -= 1
                self._counted = False
            if self.flow is None:  # refused before uvicorn saw it
                return
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._closed_by_guard or self.parser is None:
                return
            if not self._headers_pending:
                super().data_received(data)
                return
            if self._header_timer is None:
                self._start_header_timer()
            room = guard.max_header_bytes - self._header_bytes
            if len(data) <= room:
                self._header_bytes += len(data)
                super().data_received(data)
                return
            self._header_bytes += room
            super().data_received(data[:room])
            if self._headers_pending and not self._closed_by_guard and not self.transport.is_closing():
                guard.too_large += 1
                self._close_with(too_large)
                return
            if not self.transport.is_closing():
                self.data_received(data[room:])

        # httptools callbacks
        def on_headers_complete(self) -> None:
            self._headers_pending = False
            self._cancel_header_timer()
            self._body_pending = True
            # LINGER after body_timeout: a handler reading the body answers its 408 first
            self._body_timer = self.loop.call_later(guard.body_timeout + LINGER, self._body_deadline)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._body_pending = False
            self._cancel_body_timer()
            super().on_message_complete()
            self._headers_pending, self._header_bytes = True, 0  # what comes next is a new request

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._body_pending and not self._closed_by_guard and not self.transport.is_closing():
                self._close_with(b"", linger=True)  # answered before its body ended: nothing more to read

        # the send deadline: asyncio pauses our writes while the transport's buffer is over its high mark
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(guard.send_timeout, self._send_deadline)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel_send_timer()

        def _cancel_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_deadline(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                guard.send_timed_out += 1
                self._closed_by_guard = True
                self.transport.abort()  # close() would wait to flush what this client never reads

        # the body deadline
        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_deadline(self) -> None:
            self._body_timer = None
            if self._body_pending and not self.transport.is_closing():
                guard.body_timed_out += 1
                self._close_with(b"")

        # the header deadline
        def _start_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(guard.header_timeout, self._header_deadline)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self._headers_pending and not self.transport.is_closing():
                guard.timed_out += 1
                self._close_with(too_slow if self._header_bytes else b"")

        def _close_with(self, response: bytes, linger: bool = False) -> None:
            """Answer and close. With an answer (or `linger`: one was sent already), a lingering close:
            our side is shut for writing and what the client still sends is read and dropped for up to
            LINGER seconds, so that its kernel does not discard the answer (a close with unread data
            sends a reset)."""
            self._closed_by_guard = True
            self._cancel_header_timer()
            self._cancel_body_timer()
            if not response and not linger:
                self.transport.close()
                return
            if response:
                self.transport.write(response)
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER, self.transport.close)
            else:
                self.transport.close()

    return GuardedHttpToolsProtocol
