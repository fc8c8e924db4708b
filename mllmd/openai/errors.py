"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from mllmd.messages import RequestFailed


class APIError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI-shaped JSON body.

    ``retry_after`` (seconds) is sent as a ``Retry-After`` header (429, 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        """The JSON body OpenAI sends for an error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        """Extra HTTP headers for the response (``Retry-After`` when set)."""
        return {} if self.retry_after is None else {"Retry-After": str(max(0, int(self.retry_after)))}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is malformed or a field is invalid (``param`` names it)."""
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(
    message: str = "Invalid or missing API key (send 'Authorization: Bearer <key>').",
) -> APIError:
    """401: missing or wrong API key. The message must never echo the key."""
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """404: unknown route, model or object."""
    return APIError(404, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> APIError:
    """404 for a ``model`` the server does not serve (OpenAI's code ``model_not_found``)."""
    shown = model if len(model) <= 200 else model[:200] + "..."  # a client's megabyte of name is not echoed
    return not_found(f"The model '{shown}' does not exist or is not loaded.", "model", "model_not_found")


def payload_too_large(message: str = "Request body is too large.") -> APIError:
    """413: the request body exceeds the configured limit."""
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


def rate_limited(message: str = "Too many requests.", retry_after: int | None = None) -> APIError:
    """429: the waiting queue is full or a client limit was hit."""
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after)


def service_unavailable(message: str, retry_after: int = 5) -> APIError:
    """503: no model loaded, worker restarting, draining; retry after ``retry_after`` seconds."""
    return APIError(503, message, "service_unavailable_error", None, "service_unavailable", retry_after)


def internal_error(message: str = "Internal server error.") -> APIError:
    """500: an unexpected failure (the message must not leak internals or secrets)."""
    return APIError(500, message, "server_error", None, None)


# A worker's RequestFailed code -> the HTTP status main answers with.
_FAILURE_STATUS = {"invalid_request": 400, "unavailable": 503, "internal": 500}


def failure_status(failure: RequestFailed) -> int:
    return _FAILURE_STATUS[failure.code]


def error_for_failure(failure: RequestFailed) -> APIError:
    """The APIError for a request a worker failed (503s say when to retry: a lost worker, a shutdown)."""
    status = failure_status(failure)
    if status == 503:
        return service_unavailable(failure.message)
    return APIError(status, failure.message, "invalid_request_error" if status < 500 else "server_error",
                    param=failure.param)
