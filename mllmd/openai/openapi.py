"""The OpenAPI 3.1 document of the daemon's HTTP API (served at GET /openapi.json).

Built from the same constants the parser enforces (mllmd.openai.protocol, mllmd.openai.limits and the
configured `Limits`), so a schema-driven client or fuzzer sees the real bounds: what lies inside them
is served or refused with a 400 that names the field, never a 5xx. The response schemas are kept
short (OpenAI's own reference describes them in full); the error shape is exact.
"""

from __future__ import annotations

from typing import Any

from mllmd import __version__
from mllmd.openai import limits as L
from mllmd.openai import protocol as P
from mllmd.openai import responses_api as RA
from mllmd.sampling_params import MAX_TOP_LOGPROBS

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _num(lo: float, hi: float, default: float, exclusive_lo: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", "maximum": hi, "default": default}
    out["exclusiveMinimum" if exclusive_lo else "minimum"] = lo
    return out


def _int(lo: int | None = None, hi: int | None = None, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", **kw}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _sampling(limits: L.Limits, temperature_max: float = 2.0) -> dict[str, Any]:
    token = _int(0, P.MAX_INT)
    stop_string = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_length}
    return {
        "temperature": _num(0, temperature_max, 1.0),
        "top_p": _num(0, 1, 1.0, exclusive_lo=True),
        "top_k": _int(-1, P.MAX_INT, default=-1, description="-1: off"),
        "min_p": _num(0, 1, 0.0),
        "presence_penalty": _num(-2, 2, 0.0),
        "frequency_penalty": _num(-2, 2, 0.0),
        "repetition_penalty": _num(0, 1000, 1.0, exclusive_lo=True),
        "seed": _int(P.SEED_MIN, P.SEED_MAX),
        "stop": {"oneOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": P.MAX_STOP}]},
        "stop_token_ids": {"type": "array", "items": token, "maxItems": P.MAX_STOP_TOKEN_IDS},
        "ignore_eos": {"type": "boolean", "default": False},
        "logit_bias": {"type": "object", "maxProperties": L.MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": "^[0-9]{1,10}$"}, "additionalProperties": _num(-100, 100, 0)},
        "skip_special_tokens": {"type": "boolean", "default": True},
    }


def _schemas(limits: L.Limits) -> dict[str, Any]:
    token_ids = {"type": "array", "items": _int(0, P.MAX_INT), "minItems": 1}
    free_json = {"description": f"any JSON, nested at most {limits.max_json_depth} levels in the whole body; "
                                "integers within the 64-bit range"}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    image_part = {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"},
        "image_url": {"type": "object", "required": ["url"], "properties": {
            "url": {"type": "string", "minLength": 1}, "detail": {"enum": list(P.IMAGE_DETAILS)}}}}}
    tool_call = {"type": "object", "required": ["id", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1},
            "arguments": {"oneOf": [{"type": "string"}, {"type": "object", **free_json}]}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(P.CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {
            "type": "array", "maxItems": L.MAX_CONTENT_PARTS, "items": {"oneOf": [text_part, image_part]}}],
            "description": "required except for an assistant message with tool_calls"},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "maxItems": L.MAX_TOOL_CALLS, "items": tool_call},
        "tool_call_id": {"type": "string", "description": "required for role tool"},
        "reasoning_content": {"type": "string"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": L.MAX_TOOL_NAME},
            "description": {"type": "string"},
            "parameters": {"type": "object", **free_json},
            "strict": {"type": "boolean"}}}}}
    stream_options = {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                      "description": "only with stream: true"}
    common = {"model": {"type": "string"}, "stream": {"type": "boolean", "default": False},
              "stream_options": stream_options, "n": _int(1, P.MAX_N, default=1),
              "max_tokens": _int(1, P.MAX_INT), **_sampling(limits)}
    chat = {"type": "object", "required": ["messages"], "properties": {
        **common,
        "messages": {"type": "array", "minItems": 1, "maxItems": L.MAX_MESSAGES, "items": message},
        "max_completion_tokens": _int(1, P.MAX_INT),
        "tools": {"type": "array", "maxItems": L.MAX_TOOLS, "items": tool},
        "tool_choice": {"oneOf": [{"enum": list(P.TOOL_CHOICES)}, {"type": "object", "properties": {
            "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                        "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": "boolean"},
        "logprobs": {"type": "boolean", "default": False},
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS, description="requires logprobs: true"),
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
        "chat_template_kwargs": {
            "type": "object", "maxProperties": L.MAX_TEMPLATE_KWARGS,
            "propertyNames": {"pattern": f"^[A-Za-z_][A-Za-z0-9_]{{0,{L.MAX_TEMPLATE_KWARG_NAME - 1}}}$",
                              "not": {"enum": sorted(L.RESERVED_TEMPLATE_KWARGS)}},
            "properties": {"enable_thinking": {"type": "boolean"}},
            "description": "template variables only; the template comes from the model or model.chat_template"},
    }}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        **common,
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, token_ids,
                             {"type": "array", "maxItems": P.MAX_BATCH, "items": {"type": "string", "minLength": 1}},
                             {"type": "array", "maxItems": P.MAX_BATCH, "items": token_ids}],
                   "description": "a list of prompts gives n choices each, index = prompt index * n + j"},
        "echo": {"type": "boolean", "default": False},
        "logprobs": _int(0, P.MAX_COMPLETION_LOGPROBS),
        "best_of": _int(1, P.MAX_N, description="must equal n"),
    }}
    generate = {"type": "object", "properties": {
        "text": {"oneOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": P.MAX_BATCH, "items": {"type": "string", "minLength": 1}}]},
        "input_ids": {"oneOf": [token_ids, {"type": "array", "maxItems": P.MAX_BATCH, "items": token_ids}]},
        "stream": {"type": "boolean", "default": False},
        "return_logprob": {"type": "boolean", "default": False},
        "top_logprobs_num": _int(0, MAX_TOP_LOGPROBS, description="requires return_logprob: true"),
        "rid": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": P.MAX_RID_LEN},
                          {"type": "array", "maxItems": P.MAX_BATCH,
                           "items": {"type": "string", "minLength": 1, "maxLength": P.MAX_RID_LEN}}],
                "description": "the client's id for the request (one per prompt of a batch), returned as "
                               "meta_info.id and taken by the admin's /abort_request; unique while in flight"},
        "sampling_params": {"type": "object", "additionalProperties": False, "properties": {
            "max_new_tokens": _int(1, P.MAX_INT), **_sampling(limits, temperature_max=100.0)}},
    }, "description": "exactly one of text and input_ids; a list of prompts answers a list of results"}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
    return {"ChatCompletionRequest": chat, "CompletionRequest": completion, "GenerateRequest": generate,
            "ResponsesRequest": _responses(limits, free_json),
            "AbortRequest": {"type": "object", "required": ["rid"], "properties": {
                "rid": {"type": "string", "minLength": 1, "maxLength": P.MAX_RID_LEN}}},
            "LoadModelRequest": {"type": "object", "required": ["model"], "properties": {
                "model": {"type": "string", "minLength": 1, "maxLength": 4096,
                          "description": "a folder inside model.models_dir, or a folder name there"},
                "overrides": {"type": "object", "description": "engine settings (not model_path); "
                              "a tokenizer_path must lie inside model.models_dir"}}},
            "Error": error,
            "Object": {"type": "object"}}


def _responses(limits: L.Limits, free_json: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/responses: what mllmd serves of OpenAI's Responses API (mllmd.openai.responses_api)."""
    text = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(RA.TEXT_PARTS)}, "text": {"type": "string"}}}
    image = {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "input_image"}, "image_url": {"type": "string", "minLength": 1},
        "detail": {"enum": [*P.IMAGE_DETAILS, *RA.IMAGE_DETAILS]}}}
    content = {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": L.MAX_CONTENT_PARTS,
                                              "items": {"oneOf": [text, image]}}]}
    texts = {"type": "array", "items": {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}}
    items = [
        {"type": "object", "required": ["role"], "properties": {
            "type": {"const": "message"}, "role": {"enum": list(RA.MESSAGE_ROLES)}, "content": content}},
        {"type": "object", "required": ["type", "call_id", "name"], "properties": {
            "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string", "minLength": 1},
            "arguments": {"type": "string"}}, "description": "a call of the assistant turn it follows"},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": content}},
        {"type": "object", "required": ["type"], "properties": {
            "type": {"const": "reasoning"}, "content": texts, "summary": texts},
         "description": "the next assistant turn's reasoning_content"},
    ]
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "minLength": 1, "maxLength": L.MAX_TOOL_NAME},
        "description": {"type": "string"}, "parameters": {"type": "object", **free_json}, "strict": {"type": "boolean"}}}
    fmt = {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": list(P.RESPONSE_FORMATS)}, "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}},
        "description": f"json_schema needs name; the grammar as chat's response_format; at most {RA.MAX_FORMAT_JSON} "
                       "characters of JSON"}
    stateless = "refused: the server is stateless (nothing is stored)"
    return {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"}, "stream": {"type": "boolean", "default": False},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "maxItems": L.MAX_MESSAGES,
                                                   "items": {"oneOf": items}}]},
        "instructions": {"type": "string", "description": "a system message before the input"},
        "tools": {"type": "array", "maxItems": L.MAX_TOOLS, "items": tool},
        "tool_choice": {"oneOf": [{"enum": list(P.TOOL_CHOICES)}, {"type": "object", "required": ["type", "name"],
                                  "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": "boolean"}, "max_output_tokens": _int(1, P.MAX_INT),
        "text": {"type": "object", "properties": {"format": fmt}},
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": [*P.REASONING_EFFORTS, *RA.EFFORTS], "description": "none / minimal: no thinking"},
            "summary": {"enum": list(RA.SUMMARIES)}}},
        "include": {"type": "array", "items": {"type": "string"},
                    "description": f"{RA.LOGPROBS_INCLUDE} asks for logprobs; the others have no effect"},
        "top_logprobs": _int(0, MAX_TOP_LOGPROBS),
        "metadata": {"type": "object", "maxProperties": RA.MAX_METADATA,
                     "propertyNames": {"maxLength": RA.MAX_METADATA_KEY},
                     "additionalProperties": {"type": "string", "maxLength": RA.MAX_METADATA_VALUE}},
        "user": {"type": "string", "maxLength": RA.MAX_USER}, "store": {"type": "boolean", "description": "accepted; nothing is ever stored"},
        "truncation": {"enum": list(RA.TRUNCATIONS), "description": "auto is served as disabled"},
        "background": {"const": False}, "previous_response_id": {"type": "null", "description": stateless},
        "conversation": {"type": "null", "description": stateless},
        **_sampling(limits),
        "chat_template_kwargs": {"type": "object", "description": "as on /v1/chat/completions"},
    }, "description": "translated onto /v1/chat/completions: its rules, limits and parsers apply"}


def _errors(*codes: int) -> dict[str, Any]:
    why = {400: "invalid request (param names the field)", 401: "missing or wrong API key",
           403: "not allowed on this listener", 404: "unknown model or object", 408: "request too slow",
           413: "body too large", 422: "model not loadable", 431: "headers too large",
           500: "server error", 503: "not ready, draining or at capacity (Retry-After)"}
    return {str(c): {"description": why[c], "content": {JSON: {"schema": _ref("Error")}}} for c in codes}


def _op(summary: str, body: str | None = None, stream: bool = False, auth: str | None = "bearer",
        tags: tuple[str, ...] = ("api",), errors: tuple[int, ...] = (400, 401, 408, 413, 431, 503),
        events: str = "data: {...} events, then [DONE]") -> dict[str, Any]:
    ok: dict[str, Any] = {JSON: {"schema": _ref("Object")}}
    if stream:
        ok[SSE] = {"schema": {"type": "string"}, "description": f"when stream is true: {events}"}
    op: dict[str, Any] = {"summary": summary, "tags": list(tags),
                          "responses": {"200": {"description": "OK", "content": ok}, **_errors(*errors)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(body)}}}
    op["security"] = [{auth: []}] if auth else []
    return op


def _admin(summary: str, body: str | None = None, errors: tuple[int, ...] = (400, 401, 403, 408, 413, 500)
           ) -> dict[str, Any]:
    return _op(summary, body, auth="admin", tags=("admin",), errors=errors)


def openapi_document(limits: L.Limits = L.DEFAULT_LIMITS, max_request_bytes: int | None = None) -> dict[str, Any]:
    """The document, for the configured limits."""
    body_note = f" Bodies up to {max_request_bytes} bytes." if max_request_bytes else ""
    return {
        "openapi": "3.1.0",
        "info": {"title": "mllmd", "version": __version__,
                 "description": "OpenAI-compatible API of the mllmd daemon, its native /generate, and the "
                                "admin API (on the Unix socket without a key, over TCP with server.admin_api_key)."
                                + body_note},
        "paths": {
            "/health": {"get": _op("Liveness and readiness (open to all; 503 says why, without details)",
                                   auth=None, tags=("ops",), errors=(503,))},
            "/metrics": {"get": _op("Prometheus metrics (the API key only with server.metrics_require_key)",
                                    tags=("ops",), errors=(401,))},
            "/openapi.json": {"get": _op("This document", tags=("ops",), errors=(401,))},
            "/v1/models": {"get": _op("The served model", errors=(401,))},
            "/v1/models/{model}": {"get": {**_op("One model's card", errors=(401, 404)), "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
            "/v1/chat/completions": {"post": _op("Chat completion", "ChatCompletionRequest", stream=True,
                                                 errors=(400, 401, 404, 408, 413, 431, 503))},
            "/v1/completions": {"post": _op("Text completion", "CompletionRequest", stream=True,
                                            errors=(400, 401, 404, 408, 413, 431, 503))},
            "/v1/responses": {"post": _op("Responses API, stateless (nothing is stored)", "ResponsesRequest",
                                          stream=True, errors=(400, 401, 404, 408, 413, 431, 503),
                                          events="event: / data: {...} pairs, response.created to response."
                                                 "completed (or .incomplete, .failed), no [DONE]")},
            "/generate": {"post": _op("Native generation (SGLang-style)", "GenerateRequest", stream=True)},
            "/tokenize": {"post": _op("Token ids of a prompt or chat, as a generation builds them (vLLM's shape: "
                                      "{model, prompt} or {model, messages, add_generation_prompt} -> "
                                      "{tokens, count, max_model_len})", "Object")},
            "/detokenize": {"post": _op("The text of token ids (vLLM's shape: {model, tokens} -> {prompt})", "Object")},
            "/abort_request": {"post": _op("Abort a request by id (admin only: the Unix socket or the admin key; "
                                           "a client aborts its own request by closing its connection)",
                                           "AbortRequest", errors=(400, 401, 403, 404, 408, 413))},
            "/admin/status": {"get": _admin("Daemon status")},
            "/admin/models": {"get": _admin("Model folders under model.models_dir")},
            "/admin/requests": {"get": _admin("The requests in flight (their ids, for /abort_request)")},
            "/admin/models/load": {"post": _admin("Load (hot-swap to) a model", "LoadModelRequest",
                                                  errors=(400, 401, 403, 408, 413, 422, 500))},
            "/admin/models/unload": {"post": _admin("Unload the model")},
            "/admin/drain": {"post": _admin("Stop accepting new requests")},
            "/admin/flush-cache": {"post": _admin("Flush the prefix cache")},
            "/admin/reload": {"post": _admin("Re-read the configuration")},
        },
        "components": {
            "schemas": _schemas(limits),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "server.api_key"},
                                "admin": {"type": "http", "scheme": "bearer", "description": "server.admin_api_key"}},
        },
    }
