"""The Starlette app: OpenAI API, native /generate, /health. Never imports torch.

Every handler answers in OpenAI's error shape whatever goes wrong: an exception that is not an
APIError is logged (rate-limited) and answered 500, and whatever the request had registered is
released (see `Api._respond`). Bodies above OFFLOAD_BYTES are decoded and validated in a thread, so
that one large body never stalls the event loop (and /health) for long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mllmd.daemon.admin import admin_routes
from mllmd.daemon.http_common import bearer_matches, error_response, is_admin, parse_body, read_body
from mllmd.daemon.ratelimit import RateLimitedLog
from mllmd.messages import ChatPrompt, Prompt, RequestFailed, TextPrompt, TokenPrompt
from mllmd.openai import protocol, serving
from mllmd.openai import responses as R
from mllmd.openai.errors import (
    APIError,
    bad_request,
    internal_error,
    model_not_found,
    not_found,
    service_unavailable,
    unauthorized,
)
from mllmd.openai.limits import Limits
from mllmd.openai.openapi import openapi_document

if TYPE_CHECKING:
    from mllmd.daemon.main import Daemon

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
logger = logging.getLogger("mllmd.http")
_errors = RateLimitedLog(logger)


class Api:
    """Route handlers bound to the daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    # ---- helpers -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        key = self.d.config.api_key
        if not key:
            return
        if not bearer_matches(request, key):
            raise unauthorized("Missing or invalid API key: send 'Authorization: Bearer <key>'.")

    def _check_model(self, model: str | None) -> None:
        name = self.d.served_model_name
        if name is None:
            raise service_unavailable("No model is loaded.")
        if model is not None and model != name:
            raise model_not_found(model)

    def _check_ready(self) -> None:
        reason = self.d.not_ready_reason()
        if reason is not None:
            raise service_unavailable(reason)

    def _check_images(self, count: int) -> None:
        """Images need a model with a vision tower, and at most server.max_images_per_request of them
        (the sources themselves are checked where they are loaded, in the tokenizer worker)."""
        active = self.d.active
        if active is None or not active.facts.takes_images:
            raise bad_request("images are not supported by the loaded model", "messages")
        most = self.d.config.server.max_images_per_request
        if count > most:
            raise bad_request(f"{count} images in the request exceeds server.max_images_per_request={most}", "messages")

    async def _parse(self, request: Request, parse: Callable[[Any, Limits], Any]) -> Any:
        srv = self.d.config.server
        body = await read_body(request, srv.max_request_bytes, srv.body_timeout)
        return await parse_body(body, self.d.limits, parse)

    async def _respond(self, request: Request, states: list[Any], stream: AsyncIterator[bytes] | None,
                       full: Awaitable[Any] | None) -> Response:
        """Stream or collect the request's results. Whatever goes wrong before the response is handed
        over (an error before the first token, the client leaving, any exception), its requests are
        released here; a stream's body releases them when it ends."""
        try:
            if stream is not None:
                return await self._stream(request, states, stream)
            assert full is not None
            return JSONResponse(await self._watch(request, states, full))
        except BaseException:
            for s in states:
                await s.owner.abort(s.rid)
            raise

    async def _watch(self, request: Request, states: list[Any], work: Awaitable[Any]) -> Any:
        """Await `work`; if the client goes away first, abort its requests."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                for s in states:
                    await s.owner.abort(s.rid)
                raise ClientDisconnect()

    async def _stream(self, request: Request, states: list[Any], gen: AsyncIterator[bytes]) -> StreamingResponse:
        """Stream `gen` as SSE, once every choice has its first result: an error known before the
        first token (prompt too long, no room for max_tokens, a lost worker) is an HTTP error."""
        error = await self._watch(request, states, _first_error(states))
        if error is not None:
            for s in states:
                await s.owner.abort(s.rid)
            serving.raise_if_error(error)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen:
                    yield chunk
            except Exception:  # the status line is gone: end the stream with an error event
                _errors.exception(f"stream:{request.url.path}", "a %s stream failed", request.url.path)
                yield R.sse({"error": {"message": "Internal server error.", "type": "server_error",
                                       "param": None, "code": 500}})
            finally:
                for s in states:
                    await s.owner.abort(s.rid)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _submit(self, prompt: Prompt, req: Any, n: int, prompt_param: str) -> list[Any]:
        """Validate the request's sampling fields, then hand the prompt to the serving slot."""
        params = req.sampling_params()
        slot = self.d.serving_slot(n)
        return await slot.rm.submit(prompt, params, req.output_budget(), n, prompt_param, slot.context_length)

    # ---- routes ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """Open to everyone: the reason it gives is the public one (no paths, no load errors) unless
        the caller is the admin (Unix socket, or the admin key)."""
        reason = self.d.not_ready_reason(detail=is_admin(request, self.d.config.admin_api_key))
        if reason is None:
            return JSONResponse({"status": "ok", "state": self.d.state})
        return JSONResponse({"status": "unavailable", "state": self.d.state, "reason": reason}, status_code=503)

    async def models(self, request: Request) -> Response:
        self._auth(request)
        names = [self.d.served_model_name] if self.d.served_model_name else []
        return JSONResponse(R.models_list(names, self.d.started_at))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card, or OpenAI's 404 model_not_found."""
        self._auth(request)
        name = request.path_params["model"]
        if not self.d.served_model_name or name != self.d.served_model_name:
            raise model_not_found(name)
        return JSONResponse(R.model_card(name, self.d.started_at))

    async def chat(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_chat_request)
        self._check_model(req.model)
        self._check_ready()
        if req.image_urls:
            self._check_images(len(req.image_urls))
        prompt = ChatPrompt(req.messages, req.tools if req.tool_choice != "none" else None, req.chat_template_kwargs)
        states = await self._submit(prompt, req, req.n, "messages")
        srv, slot = self.d.config.server, self.d.active
        parsers = slot.chat_parsers(srv.reasoning_parser, srv.tool_call_parser) if slot is not None else (None, None)
        opts = serving.ChatOptions(self.d.served_model_name or "", *parsers)
        if req.stream:
            return await self._respond(request, states, serving.chat_stream(states, req, opts), None)
        return await self._respond(request, states, None, serving.chat_full(states, req, opts))

    async def completions(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_completion_request)
        self._check_model(req.model)
        self._check_ready()
        if len(req.prompts) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = req.prompts[0]
        states = await self._submit(_prompt(prompt), req, req.n, "prompt")
        echo = [prompt if isinstance(prompt, str) else ""] * req.n
        model = self.d.served_model_name or ""
        if req.stream:
            return await self._respond(request, states, serving.completion_stream(states, req, model, echo), None)
        return await self._respond(request, states, None, serving.completion_full(states, req, model, echo))

    async def generate(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_generate_request)
        self._check_model(None)
        self._check_ready()
        if req.batch_size != 1:
            raise bad_request("batched /generate is not supported; send one prompt per request", "text")
        states = await self._submit(_prompt(req.prompts[0]), req, 1, "prompt")
        if req.stream:
            return await self._respond(request, states, serving.generate_stream(states), None)
        return await self._respond(request, states, None, _first_of(serving.generate_full(states)))

    async def abort_request(self, request: Request) -> Response:
        """Abort a request by id: only over the admin API (the Unix socket, or the admin key). A client
        aborts its own request by closing its connection; nobody else can abort it."""
        admin = is_admin(request, self.d.config.admin_api_key)
        if not admin:
            self._auth(request)
        srv = self.d.config.server
        body = await parse_body(await read_body(request, srv.max_request_bytes, srv.body_timeout), self.d.limits)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid or len(rid) > protocol.MAX_RID_LEN:
            raise bad_request(f"'rid' must be a request id (a string of 1 to {protocol.MAX_RID_LEN} characters)",
                              "rid")
        if not admin:
            raise APIError(403, "aborting a request by id needs the admin API (the Unix socket, or "
                           "server.admin_api_key); a client aborts its own request by closing its connection",
                           "permission_error", "rid", "abort_forbidden")
        aborted: list[str] = []
        for slot in self.d.slots():
            aborted += await slot.rm.abort_by_admin(rid)
        if not aborted:
            raise not_found(f"no request {rid!r} is in flight", "rid", "request_not_found")
        return JSONResponse({"aborted": aborted})

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI document of this API, with the configured bounds (for clients and fuzzers)."""
        self._auth(request)
        return JSONResponse(openapi_document(self.d.limits, self.d.config.server.max_request_bytes))

    async def metrics(self, request: Request) -> Response:
        if self.d.config.server.metrics_require_key:
            self._auth(request)
        body, content_type = self.d.metrics.render()
        return Response(body, media_type=content_type)


async def _first_of(results: Awaitable[list[Any]]) -> Any:
    return (await results)[0]


def _prompt(prompt: str | list[int]) -> Prompt:
    return TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(prompt)


async def _first_error(states: list[Any]) -> RequestFailed | None:
    """Wait for each state's first item (left at the head of its queue); the first error, if any."""
    for s in states:
        item = await s.queue.get()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queue.put_nowait(item)
        while not s.queue.empty():
            queue.put_nowait(s.queue.get_nowait())
        s.queue = queue  # no await since the get: nothing can arrive in between
        if isinstance(item, RequestFailed):
            return item
    return None


def _wrap(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:  # a bug, not the client's fault: log it (rate-limited), answer in OpenAI's shape
            _errors.exception(f"handler:{request.url.path}", "%s %s failed", request.method, request.url.path)
            return error_response(internal_error())

    return endpoint


def build_app(daemon: Daemon) -> Starlette:
    api = Api(daemon)
    routes = [
        Route("/health", _wrap(api.health), methods=["GET"]),
        Route("/v1/models", _wrap(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", _wrap(api.model), methods=["GET"]),
        Route("/v1/chat/completions", _wrap(api.chat), methods=["POST"]),
        Route("/v1/completions", _wrap(api.completions), methods=["POST"]),
        Route("/generate", _wrap(api.generate), methods=["POST"]),
        Route("/abort_request", _wrap(api.abort_request), methods=["POST"]),
        Route("/metrics", _wrap(api.metrics), methods=["GET"]),
        Route("/openapi.json", _wrap(api.openapi), methods=["GET"]),
        *admin_routes(daemon),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)

    async def bad_method(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"method {request.method} not allowed on {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": None}}, status_code=405)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
