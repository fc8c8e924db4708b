"""The Starlette app: OpenAI API, native /generate, /health. Never imports torch.

Every handler answers in OpenAI's error shape whatever goes wrong: an exception that is not an
APIError is logged (rate-limited) and answered 500, and whatever the request had registered is
released (see `Api._respond`). Bodies above OFFLOAD_BYTES are decoded and validated in a thread, so
that one large body never stalls the event loop (and /health) for long.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mllmd.daemon.access import RequestContext, request_info
from mllmd.daemon.admin import admin_routes
from mllmd.daemon.browser_guard import BrowserGuard
from mllmd.daemon.config import is_loopback_host
from mllmd.daemon.cors import CORS
from mllmd.daemon.http_common import any_bearer_matches, error_response, is_admin, parse_body, read_body
from mllmd.daemon.ratelimit import RateLimitedLog
from mllmd.messages import (
    ChatPrompt,
    OutputBudget,
    Prompt,
    RequestFailed,
    TextPrompt,
    TokenizeOnly,
    TokenPrompt,
)
from mllmd.openai import protocol, responses_api, responses_output, serving
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
from mllmd.sampling_params import OutputConstraint
from mllmd.structured.grammar import tool_call_format

if TYPE_CHECKING:
    from mllmd.daemon.main import Daemon

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# how the event that ends a failed stream begins: chat, completions and /generate; the Responses API
ERROR_EVENTS = (serving.ERROR_EVENT_PREFIX, responses_output.FAILED_EVENT_PREFIX)
StreamError = Callable[[RequestFailed], bytes]  # the event that ends a stream failing after its 200
logger = logging.getLogger("mllmd.http")
_errors = RateLimitedLog(logger)


class Api:
    """Route handlers bound to the daemon."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    # ---- helpers -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        keys = self.d.config.api_keys
        if not keys:
            return
        if not any_bearer_matches(request, keys):
            raise unauthorized("Missing or invalid API key: send 'Authorization: Bearer <key>'.")

    def _check_model(self, model: str | None) -> str:
        """The name to answer with: the one the request asked for (any alias of the served model), or
        the primary name when it named none. 503 while no model serves (saying so while one loads)."""
        names = self.d.served_model_names
        if not names:
            if self.d.pending is not None:
                raise service_unavailable("The model is still loading; retry shortly.", retry_after=5)
            raise service_unavailable("No model is loaded.")
        if model is not None and model not in names:
            raise model_not_found(model)
        return model if model is not None else names[0]

    def _check_ready(self) -> None:
        reason = self.d.not_ready_reason()
        if reason is not None:
            raise service_unavailable(reason)

    def _check_images(self, count: int, param: str) -> None:
        """Images need a model with a vision tower, and at most server.max_images_per_request of them
        (the sources themselves are checked where they are loaded, in the tokenizer worker)."""
        active = self.d.active
        if active is None or not active.facts.takes_images:
            raise bad_request("images are not supported by the loaded model", param)
        most = active.max_images_per_request or self.d.config.server.max_images_per_request
        if count > most:
            raise bad_request(f"{count} images in the request exceeds server.max_images_per_request={most}", param)

    async def _parse(self, request: Request, parse: Callable[[Any, Limits], Any]) -> Any:
        srv = self.d.config.server
        body = await read_body(request, srv.max_request_bytes, srv.body_timeout, self.d.bodies)
        return await parse_body(body, self.d.limits, parse)

    async def _respond(self, request: Request, states: list[Any], stream: AsyncIterator[bytes] | None,
                       full: Awaitable[Any] | None, on_error: StreamError = serving.stream_error) -> Response:
        """Stream or collect the request's results. Whatever goes wrong before the response is handed
        over (an error before the first token, the client leaving, any exception), its requests are
        released here; a stream's body releases them when it ends."""
        try:
            if stream is not None:
                return await self._stream(request, states, stream, on_error)
            assert full is not None
            return JSONResponse(await self._watch(request, states, full))
        except BaseException:
            for s in states:
                await s.owner.abort(s.rid)
            raise

    async def _watch(self, request: Request, states: list[Any], work: Awaitable[Any],
                     timeout: float | None = None) -> Any:
        """Await `work`; if the client goes away first, abort its requests. With `timeout`, return
        a _Pending holding it once that has passed (the work goes on)."""
        task = asyncio.ensure_future(work)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25 if deadline is None else
                                         max(0.0, min(0.25, deadline - asyncio.get_running_loop().time())))
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                for s in states:
                    await s.owner.abort(s.rid)
                raise ClientDisconnect()
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                return _Pending(task)

    async def _stream(self, request: Request, states: list[Any], gen: AsyncIterator[bytes],
                      on_error: StreamError) -> StreamingResponse:
        """Stream `gen` as SSE, once every choice has its first result: an error known before the
        first token (prompt too long, no room for max_tokens, a lost worker) is an HTTP error. A first
        result slower than server.sse_keepalive_interval (a queue, a long prefill) starts the stream
        anyway, with SSE comments every interval until it comes (then an error is the event `on_error`
        makes, as is a failure of `gen` itself)."""
        interval = self.d.config.server.sse_keepalive_interval
        first = await self._watch(request, states, _first_error(states), interval if interval > 0 else None)
        if isinstance(first, RequestFailed):
            for s in states:
                await s.owner.abort(s.rid)
            serving.raise_if_error(first)

        info = request_info(request.scope)

        async def body() -> AsyncIterator[bytes]:
            try:
                if isinstance(first, _Pending):
                    error = None
                    async for beat in _keepalives(first.task, interval):
                        if isinstance(beat, RequestFailed):
                            error = beat
                        else:
                            yield beat
                    if error is not None:
                        if info is not None:
                            info.stream_error = True
                        yield on_error(error)
                        return
                sent = False
                async for chunk in gen:
                    if info is not None and chunk.startswith(ERROR_EVENTS):
                        info.stream_error = True  # the access log's outcome
                    yield chunk
                    if not sent:  # resumed: the server has taken the first event (StreamingResponse's send)
                        sent = True
                        firsts = [s.first_at for s in states if s.first_at is not None]
                        if firsts:
                            self.d.metrics.on_hop("to_client", time.perf_counter() - min(firsts))
            except Exception:  # the status line is gone: end the stream with an error event
                if info is not None:
                    info.stream_error = True
                _errors.exception(f"stream:{request.url.path}", "a %s stream failed", request.url.path)
                yield on_error(RequestFailed("", "internal", internal_error().message))
            finally:
                if isinstance(first, _Pending):
                    first.task.cancel()  # the client left during the keep-alives: nobody waits for it
                for s in states:
                    await s.owner.abort(s.rid)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _submit(self, request: Request, prompt: Prompt, req: Any, n: int, prompt_param: str,
                      constraint: OutputConstraint | None = None, alias: str | None = None) -> list[Any]:
        """Validate the request's sampling fields, then hand the prompt to the serving slot
        (`constraint`: the grammar of a structured reply, compiled by the tokenizer worker)."""
        params = req.sampling_params()
        params.constraint = constraint
        slot = self.d.serving_slot(n)
        budget = self._budget(req.output_budget(), slot.info.max_total_tokens if slot.info is not None else None)
        info = request_info(request.scope)
        if info is not None and not info.states:  # a batch's first prompt: the request's own way in
            self.d.metrics.on_hop("http_in", time.perf_counter() - info.received, model_name=slot.served_name)
        states = await slot.rm.submit(prompt, params, budget, n, prompt_param, slot.context_length, alias)
        if info is not None:  # the access log reads their token counts
            info.states = states
        return states

    async def _submit_batch(self, request: Request, req: Any, n: int, batch_param: str,
                            aliases: list[str] | None = None) -> list[Any]:
        """Submit each of `req.prompts` with n choices: choice index = prompt index * n + j (OpenAI's
        order). The batch is admitted whole or not at all, and a prompt refused midway releases those
        sent before it. `aliases`: the client's own id for each prompt (native /generate's `rid`)."""
        self.d.serving_slot(len(req.prompts) * n, batch_param if len(req.prompts) > 1 else "n")
        states: list[Any] = []
        try:
            for i, prompt in enumerate(req.prompts):
                states += await self._submit(request, _prompt(prompt), req, n, batch_param,
                                             alias=aliases[i] if aliases else None)
        except BaseException:
            for s in states:
                await s.owner.abort(s.rid)
            raise
        info = request_info(request.scope)
        if info is not None:  # the access log counts every prompt's tokens
            info.states = states
        return states

    def _budget(self, budget: OutputBudget, kv_tokens: int | None) -> OutputBudget:
        """The client's budget with the server's output-token default (server.default_max_tokens, for a
        request that gives none), cap (server.max_tokens_cap, for every request) and the serving
        model's KV cache size (`kv_tokens`)."""
        srv = self.d.config.server
        default = budget.default if budget.default is not None else srv.default_max_tokens
        requested = budget.requested
        cap = srv.max_tokens_cap
        if cap is not None:
            default = cap if default is None else min(default, cap)
            requested = None if requested is None else min(requested, cap)
        return OutputBudget(requested, default, budget.param, kv_tokens or None)

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
        return JSONResponse(R.models_list(list(self.d.served_model_names), self.d.started_at))

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card, or OpenAI's 404 model_not_found."""
        self._auth(request)
        name = request.path_params["model"]
        if name not in self.d.served_model_names:
            raise model_not_found(name)
        return JSONResponse(R.model_card(name, self.d.started_at))

    async def _submit_chat(self, request: Request, req: protocol.ChatRequest, prompt_param: str
                           ) -> tuple[list[Any], serving.ChatOptions]:
        """Submit a validated chat request (`prompt_param`: the field its messages came from)."""
        model = self._check_model(req.model)
        self._check_ready()
        if req.image_urls:
            self._check_images(len(req.image_urls), prompt_param)
        prompt = req.chat_prompt()
        srv, slot = self.d.config.server, self.d.active
        parsers = slot.chat_parsers(srv.reasoning_parser, srv.tool_call_parser) if slot is not None else (None, None)
        constraint = req.output_constraint(tool_call_format(parsers[1]))
        states = await self._submit(request, prompt, req, req.n, prompt_param, constraint)
        return states, serving.ChatOptions(model, *parsers)

    async def chat(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_chat_request)
        states, opts = await self._submit_chat(request, req, "messages")
        if req.stream:
            return await self._respond(request, states, serving.chat_stream(states, req, opts), None)
        return await self._respond(request, states, None, serving.chat_full(states, req, opts))

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: the Responses API, translated onto chat (mllmd.openai.responses_api)."""
        self._auth(request)
        req = await self._parse(request, responses_api.parse_responses_request)
        try:
            states, opts = await self._submit_chat(request, req.chat, "input")
            asm = responses_output.ResponseAssembler(req, opts)
            if req.stream:
                return await self._respond(request, states, responses_output.response_stream(states, asm), None,
                                           asm.failure_event)
            return await self._respond(request, states, None, responses_output.response_full(states, asm))
        except APIError as e:  # a chat field the workers or the sampling checks refused: the Responses name
            raise req.params.error(e) from None

    async def completions(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_completion_request)
        model = self._check_model(req.model)
        self._check_ready()
        echo = await self._echo_texts(req.prompts, req.n) if req.echo else [""] * (len(req.prompts) * req.n)
        states = await self._submit_batch(request, req, req.n, "prompt")
        if req.stream:
            return await self._respond(request, states, serving.completion_stream(states, req, model, echo), None)
        return await self._respond(request, states, None, serving.completion_full(states, req, model, echo))

    async def generate(self, request: Request) -> Response:
        self._auth(request)
        req = await self._parse(request, protocol.parse_generate_request)
        self._check_model(None)
        self._check_ready()
        states = await self._submit_batch(request, req, 1, "text" if req.texts is not None else "input_ids",
                                          req.rids)
        if req.stream:
            return await self._respond(request, states, serving.generate_stream(states, req), None)
        full = serving.generate_full(states, req)
        return await self._respond(request, states, None, full if req.is_batch else _first_of(full))

    async def abort_request(self, request: Request) -> Response:
        """Abort a request by id: only over the admin API (the Unix socket, or the admin key). A client
        aborts its own request by closing its connection; nobody else can abort it."""
        admin = is_admin(request, self.d.config.admin_api_key)
        if not admin:
            self._auth(request)
        srv = self.d.config.server
        body = await parse_body(await read_body(request, srv.max_request_bytes, srv.body_timeout, self.d.bodies), self.d.limits)
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

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's shape): {"model", "prompt"} or {"model", "messages",
        "add_generation_prompt"} -> {"tokens", "count", "max_model_len"}: the ids a generation would see."""
        self._auth(request)
        body = await self._parse(request, _object_body)
        self._check_model(_model_field(body))
        add_gen = body.get("add_generation_prompt", True)
        if not isinstance(add_gen, bool):
            raise bad_request("'add_generation_prompt' must be a boolean", "add_generation_prompt")
        prompt: ChatPrompt | TextPrompt
        if "messages" in body:
            chat = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if k in body}
            req = protocol.parse_chat_request(chat, self.d.limits)
            if req.image_urls:
                raise bad_request("/tokenize does not take images", "messages")
            prompt = req.chat_prompt()
        elif isinstance(body.get("prompt"), str):
            prompt = TextPrompt(body["prompt"])
        else:
            raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
        slot = self.d.serving_slot(1)
        ids = (await self._tokenizer(slot, TokenizeOnly(_query_id(), prompt, add_gen))).ids
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": slot.context_length})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's shape): {"model", "tokens"} -> {"prompt": text}."""
        self._auth(request)
        body = await self._parse(request, _object_body)
        self._check_model(_model_field(body))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("'tokens' must be a list of token ids (integers)", "tokens")
        if len(tokens) > MAX_DETOKENIZE:
            raise bad_request(f"'tokens' may hold at most {MAX_DETOKENIZE} ids", "tokens")
        if any(not 0 <= t < 1 << 31 for t in tokens):
            raise bad_request("'tokens' holds an id outside the vocabulary", "tokens")
        slot = self.d.serving_slot(1)
        texts = (await self._tokenizer(slot, TokenizeOnly(_query_id(), None, decode=[tokens]))).texts
        return JSONResponse({"prompt": texts[0]})

    async def _echo_texts(self, prompts: list[str | list[int]], n: int) -> list[str]:
        """Each choice's prompt as `echo` returns it: a prompt of token ids as the tokenizer decodes it
        (all of a request's in one /detokenize job)."""
        ids = [list(p) for p in prompts if not isinstance(p, str)]
        decoded: list[str] = []
        if ids:
            slot = self.d.serving_slot(1)
            decoded = (await self._tokenizer(slot, TokenizeOnly(_query_id(), None, decode=ids))).texts
        it = iter(decoded)
        return [text for p in prompts for text in [p if isinstance(p, str) else next(it)] * n]

    async def _tokenizer(self, slot: Any, msg: TokenizeOnly) -> Any:
        result = await slot.tokenize_only(msg)
        if result is None:
            raise service_unavailable("the tokenizer worker did not answer; retry shortly")
        if result.unavailable:
            raise service_unavailable(result.error or "the tokenizer worker is busy; retry shortly")
        if result.error is not None:
            raise bad_request(result.error, "tokens" if msg.prompt is None else "prompt")
        return result

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


KEEPALIVE = b": keep-alive\n\n"


@dataclass
class _Pending:
    """The first results had not all come when the keep-alive interval passed."""

    task: asyncio.Future[RequestFailed | None]


async def _keepalives(task: asyncio.Future[RequestFailed | None], interval: float) -> AsyncIterator[Any]:
    """An SSE comment every `interval` seconds until `task` (the first results) is done; then its
    error, if any."""
    while True:
        yield KEEPALIVE
        done, _ = await asyncio.wait({task}, timeout=interval)
        if done:
            error = task.result()
            if error is not None:
                yield error
            return


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


MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize request (the body size bounds it too)


def _object_body(value: Any, limits: Limits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return value


def _model_field(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    return model


def _query_id() -> str:
    return secrets.token_hex(8)


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
        Route("/v1/responses", _wrap(api.responses), methods=["POST"]),
        Route("/generate", _wrap(api.generate), methods=["POST"]),
        Route("/abort_request", _wrap(api.abort_request), methods=["POST"]),
        Route("/metrics", _wrap(api.metrics), methods=["GET"]),
        Route("/openapi.json", _wrap(api.openapi), methods=["GET"]),
        Route("/tokenize", _wrap(api.tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(api.detokenize), methods=["POST"]),
        *admin_routes(daemon),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}}, status_code=404)

    async def bad_method(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": {"message": f"method {request.method} not allowed on {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": None}}, status_code=405)

    # outermost first: every response (a CORS preflight too) carries the request id and is logged
    srv = daemon.config.server
    middleware = [Middleware(RequestContext), Middleware(CORS, origins=srv.cors_allow_origins),
                  Middleware(BrowserGuard, origins=srv.cors_allow_origins, hosts=srv.allowed_hosts,
                             loopback_only=is_loopback_host(srv.host))]  # fmt: skip
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method}, middleware=middleware)
