"""Per-request context of the HTTP layer: the request id (X-Request-Id) and the access log.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would run the handler in another
task and lose the contextvar): it takes the client's `X-Request-Id` when it is printable ASCII of
bounded length, else makes one; sets it in `mllmd.logfmt.request_id` for every log line of the
request; returns it on every response (errors and SSE included); and, when the response has ended,
writes one INFO line to the `mllmd.access` logger: method, route, status, how the response ended
(`outcome`: ok; cut, when its body never ended, a client that left mid-stream; error, a stream that
ended with an error event after its 200), tokens when known, latency, request id. Never bodies,
headers or keys.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from mllmd.logfmt import request_id

MAX_REQUEST_ID = 128  # characters of a client's X-Request-Id; longer ones are replaced
access_logger = logging.getLogger("mllmd.access")
Scope = MutableMapping[str, Any]


def sanitize_request_id(raw: bytes | None) -> str:
    """The client's id if it is 1..MAX_REQUEST_ID printable ASCII characters (no spaces), else a new one:
    whatever is accepted is safe on a log line and in a response header."""
    if raw and len(raw) <= MAX_REQUEST_ID and all(0x21 <= b <= 0x7E for b in raw):
        return raw.decode("ascii")
    return secrets.token_hex(16)


@dataclass
class RequestInfo:
    """What a handler tells the access log about its request (found in scope["state"]["mllmd"])."""

    request_id: str
    states: list[Any] = field(default_factory=list)  # RequestStates: their last outputs carry token counts
    stream_error: bool = False  # a stream ended with an error event (its status line said 200)
    received: float = 0.0  # time.perf_counter() when the app got the request (the first first-token hop)

    def tokens(self) -> tuple[int | None, int | None]:
        """(prompt, completion) tokens so far; (None, None) when the request generated nothing."""
        lasts = [s.last for s in self.states if getattr(s, "last", None) is not None]
        if not lasts:
            return None, None
        return max(x.prompt_tokens for x in lasts), sum(x.completion_tokens for x in lasts)


def _printable(text: str, limit: int = 256) -> str:
    """A client-chosen path made safe for a log line: control characters escaped, length bounded."""
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text[:limit])
    return out + "..." if len(text) > limit else out


def request_info(scope: Scope) -> RequestInfo | None:
    state = scope.get("state")
    return state.get("mllmd") if isinstance(state, dict) else None


class RequestContext:
    """ASGI middleware: request id in, request id out, one access-log line per request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        info = RequestInfo(sanitize_request_id(raw), received=time.perf_counter())
        scope.setdefault("state", {})["mllmd"] = info
        token = request_id.set(info.request_id)
        header = (b"x-request-id", info.request_id.encode("ascii"))
        status = [0]
        ended = [False]
        start = time.perf_counter()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            outcome = "error" if info.stream_error else "ok" if ended[0] else "cut"
            _log_access(scope, info, status[0], outcome, time.perf_counter() - start)
            request_id.reset(token)


def _log_access(scope: Scope, info: RequestInfo, status: int, outcome: str, seconds: float) -> None:
    prompt, completion = info.tokens()
    route = _printable(scope.get("path", ""))
    access_logger.info(
        "%s %s %s outcome=%s prompt_tokens=%s completion_tokens=%s %.1f ms", scope.get("method", "-"), route,
        status or "-", outcome, "-" if prompt is None else prompt, "-" if completion is None else completion,
        seconds * 1e3,
        extra={"method": scope.get("method"), "route": route, "status": status or None, "outcome": outcome,
               "prompt_tokens": prompt, "completion_tokens": completion, "latency_ms": round(seconds * 1e3, 1)},
    )
