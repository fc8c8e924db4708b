"""The daemon's listening sockets (no daemon process needed)."""

from __future__ import annotations

import asyncio
import socket

from mllmd.daemon.main import _tcp_listener


def test_accepted_tcp_connections_have_nagle_off() -> None:
    """SSE chunks are small writes: with Nagle's algorithm on, one waits for the ACK of the one before,
    and on a reused (keep-alive) connection that adds a delayed-ACK time (~40 ms) to the first token."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        listener = _tcp_listener("127.0.0.1", 0)
        nodelay: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=listener)  # as uvicorn serves the daemon's sockets
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(nodelay, 5.0)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(main()) != 0
