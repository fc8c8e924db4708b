"""The Starlette app: OpenAI API, native /generate, /health. Never imports torch."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mllmd.daemon.admin import admin_routes
from mllmd.messages import ChatPrompt, Prompt, RequestFailed, TextPrompt, TokenPrompt
from mllmd.openai import protocol, serving
from mllmd.openai import responses as R
from mllmd.openai.errors import (
    APIError,
    bad_request,
    model_not_found,
    payload_too_large,
    service_unavailable,
    unauthorized,
)

if TYPE_CHECKING:
    from mllmd.daemon.main import Daemon

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def bearer_matches(request: Request, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def error_response(e: APIError) -> JSONResponse:
    headers = {}
    retry = getattr(e, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise payload_too_large(f"request body exceeds the limit of {limit} bytes")
    return protocol.decode_json(bytes(body))


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
        reason = self.d.not_ready_reason()
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
        req = protocol.parse_chat_request(await read_json(request, self.d.config.server.max_request_bytes))
        self._check_model(req.model)
        self._check_ready()
        if req.image_urls:
            raise bad_request("images are not supported by the loaded model", "messages")
        prompt = ChatPrompt(req.messages, req.tools if req.tool_choice != "none" else None, req.chat_template_kwargs)
        states = await self._submit(prompt, req, req.n, "messages")
        opts = serving.ChatOptions(self.d.served_model_name or "", self.d.config.server.reasoning_parser,
                                   self.d.config.server.tool_call_parser)
        if req.stream:
            return await self._stream(request, states, serving.chat_stream(states, req, opts))
        return JSONResponse(await self._watch(request, states, serving.chat_full(states, req, opts)))

    async def completions(self, request: Request) -> Response:
        self._auth(request)
        req = protocol.parse_completion_request(await read_json(request, self.d.config.server.max_request_bytes))
        self._check_model(req.model)
        self._check_ready()
        if len(req.prompts) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = req.prompts[0]
        states = await self._submit(_prompt(prompt), req, req.n, "prompt")
        echo = [prompt if isinstance(prompt, str) else ""] * req.n
        model = self.d.served_model_name or ""
        if req.stream:
            return await self._stream(request, states, serving.completion_stream(states, req, model, echo))
        return JSONResponse(await self._watch(request, states, serving.completion_full(states, req, model, echo)))

    async def generate(self, request: Request) -> Response:
        self._auth(request)
        req = protocol.parse_generate_request(await read_json(request, self.d.config.server.max_request_bytes))
        self._check_model(None)
        self._check_ready()
        if req.batch_size != 1:
            raise bad_request("batched /generate is not supported; send one prompt per request", "text")
        states = await self._submit(_prompt(req.prompts[0]), req, 1, "prompt")
        if req.stream:
            return await self._stream(request, states, serving.generate_stream(states))
        out = await self._watch(request, states, serving.generate_full(states))
        return JSONResponse(out[0])

    async def abort_request(self, request: Request) -> Response:
        self._auth(request)
        body = await read_json(request, self.d.config.server.max_request_bytes)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise bad_request("'rid' must be a string", "rid")
        slot = self.d.active
        if slot is not None:
            await slot.rm.abort(rid)
        return JSONResponse({"aborted": rid})

    async def metrics(self, request: Request) -> Response:
        if self.d.config.server.metrics_require_key:
            self._auth(request)
        body, content_type = self.d.metrics.render()
        return Response(body, media_type=content_type)


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
        *admin_routes(daemon),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)

    async def bad_method(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"method {request.method} not allowed on {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": None}}, status_code=405)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
