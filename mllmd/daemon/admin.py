"""Admin API routes (/admin/*): on the Unix socket, or over TCP only with server.admin_api_key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mllmd.daemon.models import ModelError, find_models
from mllmd.openai.errors import APIError, bad_request, payload_too_large, unauthorized
from mllmd.openai.protocol import decode_json

if TYPE_CHECKING:
    from mllmd.daemon.main import Daemon


def from_unix_socket(request: Request) -> bool:
    """uvicorn reports a Unix-socket listener as server (path, None)."""
    server = request.scope.get("server")
    return bool(server) and server[1] is None


class AdminApi:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _authorise(self, request: Request) -> None:
        from mllmd.daemon.http_app import bearer_matches

        if from_unix_socket(request):
            return  # the socket's mode (0660, group mllmd) is the access control
        key = self.d.config.admin_api_key
        if not key:
            raise APIError(403, "the admin API is only available on the Unix socket (set server.admin_api_key "
                           "to allow it over TCP)", "permission_error", None, "admin_forbidden")
        if not bearer_matches(request, key):
            raise unauthorized("Missing or invalid admin key: send 'Authorization: Bearer <admin key>'.")

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > self.d.config.server.max_request_bytes:
            raise payload_too_large()
        if not raw.strip():
            return {}
        body = decode_json(raw)  # the API's rules: UTF-8, no NaN / Infinity, bounded nesting
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
            raise APIError(422, str(e), "invalid_request_error", "model", "model_not_loadable") from None
        return JSONResponse({"message": message, "status": self.d.status()}, status_code=202)

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
                return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)

        return endpoint

    return [
        Route("/admin/status", guarded(api.status), methods=["GET"]),
        Route("/admin/models", guarded(api.models), methods=["GET"]),
        Route("/admin/models/load", guarded(api.load), methods=["POST"]),
        Route("/admin/models/unload", guarded(api.unload), methods=["POST"]),
        Route("/admin/drain", guarded(api.drain), methods=["POST"]),
        Route("/admin/flush-cache", guarded(api.flush_cache), methods=["POST"]),
        Route("/admin/reload", guarded(api.reload), methods=["POST"]),
    ]
