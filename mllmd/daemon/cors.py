"""CORS for browser clients (`server.cors_allow_origins`; empty: off, no CORS headers at all).

A small ASGI middleware rather than Starlette's CORSMiddleware, which answers a preflight 200 and
sends Access-Control-Allow-* headers even to an origin it refuses. Here an allowed origin's preflight
(OPTIONS with Access-Control-Request-Method) is answered 204 at once, before authentication (browsers
send preflights without credentials), and its other responses carry Access-Control-Allow-Origin; an
origin not listed gets no CORS header whatever it sends (its preflight goes on to the app: a 405).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ALLOW_METHODS = b"GET, POST, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"Authorization, Content-Type, X-Request-Id"
MAX_AGE = b"600"  # seconds a browser may cache a preflight answer


def origin_key(origin: str) -> str:
    """An origin as configured or sent, compared case-insensitively and without a trailing slash (a
    browser sends scheme and host in lower case); browser_guard compares them the same way."""
    return origin.rstrip("/").lower()


class CORS:
    """ASGI middleware; `origins` as configured ("*" allows any origin)."""

    def __init__(self, app: Any, origins: Iterable[str]) -> None:
        self.app = app
        self.origins = {origin_key(o).encode() for o in origins}
        self.any = b"*" in self.origins

    def allowed(self, origin: bytes | None) -> bool:
        return origin is not None and (self.any or origin_key(origin.decode("latin-1")).encode() in self.origins)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.origins:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        if not self.allowed(origin):
            await self.app(scope, receive, send)
            return
        assert origin is not None
        base = [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers")
            preflight = [*base, (b"access-control-allow-methods", ALLOW_METHODS),
                         (b"access-control-allow-headers", asked if asked else DEFAULT_ALLOW_HEADERS),
                         (b"access-control-max-age", MAX_AGE), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 204, "headers": preflight})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *base,
                                      (b"access-control-expose-headers", b"X-Request-Id, Retry-After")]
            await send(message)

        await self.app(scope, receive, send_with_cors)
