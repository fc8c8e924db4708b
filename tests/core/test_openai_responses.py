"""OpenAI response builders, error shape and the official SDK client reading our output.

Checks that every body `mllmd.openai.responses` builds (chat completions, chat stream chunks, text
completions and their chunks, the models list, logprobs, ids and SSE framing) validates against
the official `openai` SDK's types and declares no field they lack (bar the documented
`reasoning_content`/`reasoning` extension), that `mllmd.openai.errors` gives OpenAI's error shape,
status and headers, and that the real SDK client, on a mock transport, reads our streams and turns
our 400s into `BadRequestError`.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai import _base_client
from openai.pagination import SyncPage
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from mllmd.openai import errors
from mllmd.openai import responses as R
from mllmd.openai.errors import APIError
from mllmd.openai.protocol import parse_chat_request

# our one documented extension, under both names clients read (SGLang/DeepSeek; vLLM/Ollama)
ALLOWED_EXTRAS = {"reasoning_content", "reasoning"}


def extra_fields(m: BaseModel, path: str = "$") -> list[str]:
    """Every key the SDK's models did not declare, recursively (the models allow extras)."""
    out = [f"{path}.{k}" for k in (m.model_extra or {}) if k not in ALLOWED_EXTRAS]
    for name in type(m).model_fields:
        value = getattr(m, name)
        for i, sub in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(sub, BaseModel):
                out += extra_fields(
                    sub, f"{path}.{name}[{i}]" if isinstance(value, list) else f"{path}.{name}"
                )
    return out


def check(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Validates with the SDK type, declares no unknown field, and survives SSE/JSON encoding."""
    assert json.loads(R.sse(data)[len(b"data: ") : -2]) == data
    m = model.model_validate(data)
    assert extra_fields(m) == []
    return m


# ---------------------------------------------------------------------------------------------
# Response builders


def test_ids_and_sse():
    assert R.chat_completion_id().startswith("chatcmpl-") and len(R.chat_completion_id()) == 9 + 32
    assert R.completion_id().startswith("cmpl-")
    assert R.chat_completion_id() != R.chat_completion_id()
    int(R.chat_completion_id()[9:], 16)
    assert R.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert R.SSE_DONE == b"data: [DONE]\n\n"
    assert isinstance(R.now(), int)


def _logprob_tokens() -> list[R.TokenLogprob]:
    return [
        R.TokenLogprob("Hel", -0.25, [("Hel", -0.25, None), ("He", -1.5, None)]),
        R.TokenLogprob("lo", float("-inf"), [("lo", float("-inf"), None)]),
        # a byte-level piece: its text is an escape, its bytes (chosen and alternative alike) the real ones
        R.TokenLogprob("\\xe4", -3.0, [("\\xe4", -3.0, b"\xe4"), ("a", -4.0, None)], raw=b"\xe4"),
    ]


def test_chat_completion_validates():
    tool_call = {
        "id": R.tool_call_id(),
        "type": "function",
        "function": {"name": "f", "arguments": '{"x":1}'},
    }
    body = R.chat_completion(
        R.chat_completion_id(),
        "qwen3",
        1700000000,
        [
            R.chat_choice(0, R.chat_message("Hello"), "stop", R.chat_logprobs(_logprob_tokens())),
            R.chat_choice(1, R.chat_message(None, tool_calls=[tool_call]), "tool_calls"),
            R.chat_choice(2, R.chat_message("x", reasoning_content="thinking"), "length"),
        ],
        R.usage(10, 5, cached_tokens=4, reasoning_tokens=2),
    )
    m = check(ChatCompletion, body)
    assert m.object == "chat.completion"
    assert m.choices[0].message.content == "Hello"
    lp = m.choices[0].logprobs.content
    assert [e.token for e in lp] == ["Hel", "lo", "\\xe4"]
    assert lp[0].top_logprobs[1].token == "He" and lp[0].top_logprobs[1].bytes == [72, 101]
    assert lp[1].logprob == R.MIN_LOGPROB  # -inf is not JSON
    assert lp[2].bytes == [0xE4] and lp[2].top_logprobs[0].bytes == [0xE4] and lp[2].top_logprobs[1].bytes == [97]
    assert m.choices[1].message.tool_calls[0].function.name == "f"
    assert m.choices[1].finish_reason == "tool_calls"
    assert m.choices[2].message.model_extra == {"reasoning_content": "thinking", "reasoning": "thinking"}
    assert m.usage.total_tokens == 15 and m.usage.prompt_tokens_details.cached_tokens == 4
    assert m.usage.completion_tokens_details.reasoning_tokens == 2
    assert "reasoning_content" not in body["choices"][0]["message"]
    assert "reasoning" not in body["choices"][0]["message"]


def test_chat_stream_chunks_validate():
    cid, model, created = R.chat_completion_id(), "qwen3", 1700000000
    role = R.chat_role_chunk(cid, model, created, include_usage=True)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"] is None
    content = R.chat_chunk(
        cid,
        model,
        created,
        [R.chat_chunk_choice(0, R.chat_delta("Hi"), logprobs=R.chat_logprobs(_logprob_tokens()[:1]))],
    )
    assert "usage" not in content
    thinking = R.chat_chunk(
        cid, model, created, [R.chat_chunk_choice(0, R.chat_delta(reasoning_content="hm"))]
    )
    tool = R.chat_chunk(
        cid,
        model,
        created,
        [
            R.chat_chunk_choice(
                0,
                R.chat_delta(
                    tool_calls=[
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        }
                    ]
                ),
            )
        ],
    )
    finish = R.chat_finish_chunk(cid, model, created, 0, "stop", include_usage=True)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "stop"
    final = R.chat_usage_chunk(cid, model, created, R.usage(3, 2))
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 5
    for chunk in (role, content, thinking, tool, finish, final):
        m = check(ChatCompletionChunk, chunk)
        assert m.object == "chat.completion.chunk" and m.id == cid
    assert thinking["choices"][0]["delta"] == {"reasoning_content": "hm", "reasoning": "hm"}
    delta = ChatCompletionChunk.model_validate(thinking).choices[0].delta
    assert delta.model_extra == {"reasoning_content": "hm", "reasoning": "hm"}
    with pytest.raises(ValueError):
        R.chat_chunk_choice(0, {}, "abort")


def test_completion_validates():
    toks = _logprob_tokens()
    body = R.completion(
        R.completion_id(),
        "qwen3",
        1700000000,
        [R.completion_choice(0, "Hello", "length", R.completion_logprobs(toks, text_offset=5))],
        R.usage(4, 3),
    )
    m = check(Completion, body)
    lp = m.choices[0].logprobs
    assert lp.tokens == ["Hel", "lo", "\\xe4"]
    assert lp.text_offset == [5, 8, 10]
    assert lp.top_logprobs[0] == {"Hel": -0.25, "He": -1.5}
    assert lp.token_logprobs[1] == R.MIN_LOGPROB
    with pytest.raises(ValueError):
        R.completion_choice(0, "", "tool_calls")
    echo = R.completion_logprobs([R.TokenLogprob("A", None), R.TokenLogprob("B", -1.0, [("B", -1.0, None)])])
    assert echo["token_logprobs"] == [None, -1.0] and echo["top_logprobs"] == [None, {"B": -1.0}]


def test_completion_chunks_validate():
    cid = R.completion_id()
    mid = R.completion_chunk(cid, "m", 1, [R.completion_choice(0, "Hi", None)], include_usage=True)
    assert mid["object"] == "text_completion" and mid["usage"] is None
    assert mid["choices"][0]["finish_reason"] is None
    # OpenAI streams finish_reason null, but the SDK's type declares it required (the SDK builds
    # stream chunks without validating): validate the rest of the shape.
    patched = json.loads(json.dumps(mid))
    patched["choices"][0]["finish_reason"] = "stop"
    check(Completion, patched)
    last = R.completion_chunk(cid, "m", 1, [R.completion_choice(0, "", "stop")])
    assert "usage" not in last
    check(Completion, last)
    check(Completion, R.completion_chunk(cid, "m", 1, [], usage=R.usage(1, 1)))


def test_models_list_validates():
    body = R.models_list(["qwen3-8b", "qwen3-0.6b"], 1700000000)
    page = SyncPage[Model].model_validate(body)
    assert [m.id for m in page.data] == ["qwen3-8b", "qwen3-0.6b"]
    for card in body["data"]:
        assert check(Model, card).owned_by == "mllmd"
    assert set(body) == {"object", "data"}


def test_errors_shape():
    e = errors.bad_request("'temperature' must be ...", "temperature")
    assert e.status == 400
    assert e.to_dict() == {
        "error": {
            "message": "'temperature' must be ...",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert errors.unauthorized().status == 401 and errors.unauthorized().code == "invalid_api_key"
    assert errors.not_found("no").status == 404
    assert errors.model_not_found("x").to_dict()["error"]["param"] == "model"
    assert errors.payload_too_large().status == 413
    assert errors.rate_limited(retry_after=3).headers == {"Retry-After": "3"}
    busy = errors.service_unavailable("loading", retry_after=7)
    assert busy.status == 503 and busy.headers == {"Retry-After": "7"} and busy.retry_after == 7
    assert errors.bad_request("x").headers == {}
    assert errors.internal_error().status == 500
    assert isinstance(e, Exception) and str(e) == e.message


# ---------------------------------------------------------------------------------------------
# The real SDK client reading our output (no network: a mock transport)


def _client(handler):
    httpx_mod = getattr(_base_client, "httpx2", None) or _base_client.httpx
    transport = httpx_mod.MockTransport(handler)
    return openai.OpenAI(
        base_url="http://mllmd.test/v1", api_key="k", http_client=httpx_mod.Client(transport=transport)
    ), httpx_mod


def test_sdk_client_reads_stream_and_errors():
    cid = R.chat_completion_id()
    events = [
        R.chat_role_chunk(cid, "m", 1, include_usage=True),
        R.chat_chunk(cid, "m", 1, [R.chat_chunk_choice(0, R.chat_delta("Hel"))], include_usage=True),
        R.chat_chunk(cid, "m", 1, [R.chat_chunk_choice(0, R.chat_delta("lo"))], include_usage=True),
        R.chat_finish_chunk(cid, "m", 1, 0, "stop", include_usage=True),
        R.chat_usage_chunk(cid, "m", 1, R.usage(5, 2)),
    ]
    seen: list[dict[str, Any]] = []
    holder: dict[str, Any] = {}

    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        mod = holder["mod"]
        if body.get("temperature") == 9:
            try:
                parse_chat_request(body)
            except APIError as e:
                return mod.Response(e.status, json=e.to_dict(), headers=e.headers)
        if body.get("stream"):
            stream = b"".join(R.sse(ev) for ev in events) + R.SSE_DONE
            return mod.Response(200, content=stream, headers={"content-type": "text/event-stream"})
        msg = R.chat_message("Hello")
        return mod.Response(
            200, json=R.chat_completion(cid, "m", 1, [R.chat_choice(0, msg, "stop")], R.usage(5, 2))
        )

    client, holder["mod"] = _client(handler)
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-1].usage.total_tokens == 7
    parse_chat_request(seen[-1])  # what the SDK sends parses
    out = client.chat.completions.create(model="m", messages=messages, max_completion_tokens=8, seed=1)
    assert out.choices[0].message.content == "Hello"
    assert parse_chat_request(seen[-1]).sampling_params().max_tokens == 8
    with pytest.raises(openai.BadRequestError) as info:
        client.with_options(max_retries=0).chat.completions.create(
            model="m", messages=messages, temperature=9
        )
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"
