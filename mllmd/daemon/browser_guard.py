"""What only a hostile web page sends: refused before authentication.

The daemon serves no pages, yet a page in the user's browser can reach it: a "simple" cross-origin POST
(text/plain, no preflight) is sent with the browser's Origin and runs a generation though the page
cannot read the answer (CSRF); and a page whose own host name is re-pointed at 127.0.0.1 (DNS
rebinding) is same-origin to the daemon, so it can read answers too, with a Host header naming the
page's host. Two checks, as Jupyter's server makes them:

- a POST whose `Origin` is not in `server.cors_allow_origins` is a 403 (a GET costs nothing and a
  page cannot read its answer without CORS);
- over TCP, the `Host` header must name a host of `server.allowed_hosts`; its default (empty) means
  loopback names (localhost, *.localhost, 127.0.0.0/8, ::1) while the daemon listens on a loopback
  address, and any host otherwise (a LAN listener needs an API key, which no page has). The Unix
  socket is not checked: no browser reaches it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from mllmd.daemon.config import is_loopback_host
from mllmd.daemon.cors import origin_key


def host_name(header: bytes) -> str:
    """The host of a Host header, without its port ("[::1]:30000" -> "::1")."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def loopback_name(host: str) -> bool:
    return host == "localhost" or host.endswith(".localhost") or is_loopback_host(host)


class BrowserGuard:
    """ASGI middleware; `origins`: server.cors_allow_origins ("*" any); `hosts`: server.allowed_hosts
    ("*" any); `loopback_only`: with no `hosts`, accept loopback names only."""

    def __init__(self, app: Any, origins: Iterable[str], hosts: Iterable[str], loopback_only: bool) -> None:
        self.app = app
        self.origins = {origin_key(o) for o in origins}
        self.hosts = {h.lower() for h in hosts}
        self.loopback_only = loopback_only

    def host_allowed(self, header: bytes | None) -> bool:
        if header is None or "*" in self.hosts:  # HTTP/1.0 without Host: no browser sends that
            return True
        host = host_name(header)
        if self.hosts:
            return host in self.hosts
        return not self.loopback_only or loopback_name(host)

    def origin_allowed(self, origin: bytes | None) -> bool:
        return origin is None or "*" in self.origins or origin_key(origin.decode("latin-1")) in self.origins

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", ()))
            server = scope.get("server")  # (address, port) over TCP; (path, None) on the Unix socket
            over_tcp = isinstance(server, (tuple, list)) and len(server) == 2 and server[1] is not None
            if over_tcp and not self.host_allowed(headers.get(b"host")):
                await _refuse(send, "host_not_allowed", "the Host header names a host this server does not answer "
                              "for (server.allowed_hosts; by default loopback names while it listens on loopback)")
                return
            if scope["method"] not in ("GET", "HEAD") and not self.origin_allowed(headers.get(b"origin")):
                await _refuse(send, "origin_not_allowed", "requests from a web page of another origin are refused "
                              "(list it in server.cors_allow_origins to allow it)")
                return
        await self.app(scope, receive, send)


async def _refuse(send: Any, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "permission_error", "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
