"""What the API and the admin routes share: authentication checks, error responses, body reading."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from mllmd.openai.errors import APIError, payload_too_large, service_unavailable
from mllmd.openai.limits import DEFAULT_LIMITS, Limits, decode_json

OFFLOAD_BYTES = 256 * 1024  # larger bodies are decoded and validated off the event loop


def from_unix_socket(request: Request) -> bool:
    """uvicorn reports a Unix-socket listener as server (path, None)."""
    server: tuple[str, int | None] | None = request.scope.get("server")  # the ASGI scope's (host, port)
    return server is not None and server[1] is None


def bearer_matches(request: Request, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def any_bearer_matches(request: Request, keys: tuple[str, ...]) -> bool:
    """`Authorization: Bearer <key>` for any of `keys`: each compared in constant time, all of them
    every time (no early exit: the time taken tells nothing about which key was close)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return scheme.lower() == "bearer" and matched


def error_response(e: APIError) -> JSONResponse:
    headers = {}
    retry = getattr(e, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


BODIES_IN_FLIGHT = 8  # request bodies of the largest size the main process holds while they arrive


class BodyBudget:
    """Bytes of request bodies still arriving, over all connections: at most BODIES_IN_FLIGHT x
    server.max_request_bytes (160 MiB by default), so that clients holding bodies open cannot grow the
    main process (1,000 connections x 20 MB, each a byte short, would be 20 GB); past it a 503."""

    def __init__(self, max_request_bytes: int) -> None:
        self.limit = BODIES_IN_FLIGHT * max_request_bytes
        self.used = 0

    def resize(self, max_request_bytes: int) -> None:
        """server.max_request_bytes changed (a reload): bodies already arriving keep what they hold."""
        self.limit = BODIES_IN_FLIGHT * max_request_bytes

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise service_unavailable(f"too many large request bodies are arriving at once (more than "
                                      f"{self.limit} bytes); retry shortly", retry_after=1)  # fmt: skip
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


async def read_body(request: Request, limit: int, timeout: float, budget: BodyBudget | None = None) -> bytes:
    """The request body: at most `limit` bytes (413), all of it within `timeout` seconds (408), while
    the bodies arriving together stay within `budget` (503)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(f"request body of {declared} bytes exceeds the limit of {limit} bytes "
                                "(server.max_request_bytes)")
    held = 0

    async def collect() -> bytes:
        nonlocal held
        body = bytearray()
        async for chunk in request.stream():
            if budget is not None:
                budget.take(len(chunk))
                held += len(chunk)
            body += chunk
            if len(body) > limit:
                raise payload_too_large(f"request body exceeds the limit of {limit} bytes (server.max_request_bytes)")
        return bytes(body)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (server.body_timeout)",
                       "invalid_request_error", None, "request_timeout") from None
    finally:
        if budget is not None:
            budget.give(held)


async def parse_body(body: bytes, limits: Limits, parse: Callable[[Any, Limits], Any] | None = None) -> Any:
    """Decode (and `parse`) a body; a large one in a thread, so that the event loop keeps serving."""

    def run() -> Any:
        value = decode_json(body, limits)
        return parse(value, limits) if parse is not None else value

    return await asyncio.to_thread(run) if len(body) > OFFLOAD_BYTES else run()


def is_admin(request: Request, admin_key: str | None) -> bool:
    """The caller is the administrator: on the Unix socket (its mode is the access control), or with
    the admin key over TCP."""
    return from_unix_socket(request) or (bool(admin_key) and bearer_matches(request, admin_key or ""))


async def read_json(request: Request, limit: int, timeout: float, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The body decoded with the API's JSON rules (read_body, then decode_json)."""
    return await parse_body(await read_body(request, limit, timeout), limits)
