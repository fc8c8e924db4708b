"""Admin API routes (/admin/*): on the Unix socket, or over TCP only with server.admin_api_key."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mllmd.daemon.http_common import bearer_matches, error_response, from_unix_socket, read_body
from mllmd.daemon.models import ModelError, find_models
from mllmd.daemon.ratelimit import RateLimitedLog
from mllmd.openai.errors import APIError, bad_request, internal_error, unauthorized
from mllmd.openai.limits import decode_json

if TYPE_CHECKING:
    from mllmd.daemon.main import Daemon

_errors = RateLimitedLog(logging.getLogger("mllmd.admin"))


class AdminApi:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _authorise(self, request: Request) -> None:
        if from_unix_socket(request):
            return  # the socket's mode (0660, group mllmd) is the access control
        key = self.d.config.admin_api_key
        if not key:
            raise APIError(403, "the admin API is only available on the Unix socket (set server.admin_api_key "
                           "to allow it over TCP)", "permission_error", None, "admin_forbidden")
        if not bearer_matches(request, key):
            raise unauthorized("Missing or invalid admin key: send 'Authorization: Bearer <admin key>'.")

    async def _body(self, request: Request) -> dict[str, Any]:
        srv = self.d.config.server
        raw = await read_body(request, srv.max_request_bytes, srv.body_timeout, self.d.bodies)
        if not raw.strip():
            return {}
        body = decode_json(raw, self.d.limits)  # the API's rules: UTF-8, no NaN / Infinity, bounded nesting
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    async def status(self, request: Request) -> Response:
        return JSONResponse(self.d.status())

    async def models(self, request: Request) -> Response:
        dirs = list(self.d.config.model.models_dir)
        return JSONResponse({"models_dirs": dirs, "models": find_models(dirs)})

    async def load(self, request: Request) -> Response:
        body = await self._body(request)
        ref = body.get("model") or body.get("path")
        if not isinstance(ref, str) or not ref:
            raise bad_request("'model' must be a model folder path or a folder name under a models dir", "model")
        overrides = body.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise bad_request("'overrides' must be an object of model settings", "overrides")
        try:
            message = await self.d.load_model(ref, overrides)
        except ModelError as e:
            param = "overrides" if str(e).startswith(("overrides", "unknown model override", "'overrides'")) else "model"
            raise APIError(422, str(e), "invalid_request_error", param, "model_not_loadable") from None
        return JSONResponse({"message": message, "status": self.d.status()}, status_code=202)

    async def requests(self, request: Request) -> Response:
        """The requests in flight (ids, for POST /abort_request; `client_id`: a /generate request's own
        `rid`, which /abort_request also takes), oldest first."""
        now = time.monotonic()
        rows = [{"id": s.rid, "group": s.group, "client_id": s.alias, "model": slot.served_name,
                 "age_seconds": round(now - s.created, 3)}
                for slot in self.d.slots() for s in slot.rm.reqs.values()]
        return JSONResponse({"requests": sorted(rows, key=lambda r: -r["age_seconds"])})

    async def unload(self, request: Request) -> Response:
        return JSONResponse({"message": await self.d.unload_model()})

    async def drain(self, request: Request) -> Response:
        return JSONResponse({"message": await self.d.start_drain()})

    async def flush_cache(self, request: Request) -> Response:
        return JSONResponse({"message": await self.d.flush_cache()})

    async def reload(self, request: Request) -> Response:
        return JSONResponse(self.d.reload_config())


def admin_routes(daemon: Daemon) -> list[Route]:
    api = AdminApi(daemon)

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                api._authorise(request)
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except Exception:  # a bug: logged (rate-limited), answered in the API's error shape
                _errors.exception(f"admin:{request.url.path}", "%s %s failed", request.method, request.url.path)
                return error_response(internal_error())

        return endpoint

    return [
        Route("/admin/status", guarded(api.status), methods=["GET"]),
        Route("/admin/models", guarded(api.models), methods=["GET"]),
        Route("/admin/requests", guarded(api.requests), methods=["GET"]),
        Route("/admin/models/load", guarded(api.load), methods=["POST"]),
        Route("/admin/models/unload", guarded(api.unload), methods=["POST"]),
        Route("/admin/drain", guarded(api.drain), methods=["POST"]),
        Route("/admin/flush-cache", guarded(api.flush_cache), methods=["POST"]),
        Route("/admin/reload", guarded(api.reload), methods=["POST"]),
    ]
