"""OpenAI request parsing, error shape and response builders, checked against the official SDK."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import _base_client
from openai.pagination import SyncPage
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from mllmd.openai import errors
from mllmd.openai import responses as R
from mllmd.openai.errors import APIError
from mllmd.openai.protocol import (
    GENERATE_SAMPLING_KEYS,
    MAX_N,
    UNSUPPORTED_CHAT_FIELDS,
    decode_json,
    parse_chat_request,
    parse_completion_request,
    parse_generate_request,
)
from mllmd.sampling_params import SamplingParams

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
        R.TokenLogprob("Hel", -0.25, [("Hel", -0.25), ("He", -1.5)]),
        R.TokenLogprob("lo", float("-inf"), [("lo", float("-inf"))]),
        R.TokenLogprob("\ufffd", -3.0, [], raw=b"\xe4"),
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
    assert [e.token for e in lp] == ["Hel", "lo", "\ufffd"]
    assert lp[0].top_logprobs[1].token == "He" and lp[0].top_logprobs[1].bytes == [72, 101]
    assert lp[1].logprob == R.MIN_LOGPROB  # -inf is not JSON
    assert lp[2].bytes == [0xE4]
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
    assert lp.tokens == ["Hel", "lo", "\ufffd"]
    assert lp.text_offset == [5, 8, 10]
    assert lp.top_logprobs[0] == {"Hel": -0.25, "He": -1.5}
    assert lp.token_logprobs[1] == R.MIN_LOGPROB
    with pytest.raises(ValueError):
        R.completion_choice(0, "", "tool_calls")
    echo = R.completion_logprobs([R.TokenLogprob("A", None), R.TokenLogprob("B", -1.0, [("B", -1.0)])])
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


# ---------------------------------------------------------------------------------------------
# Parsing: happy paths

USER = [{"role": "user", "content": "hi"}]


def test_chat_defaults():
    req = parse_chat_request({"model": "m", "messages": USER})
    assert req.model == "m" and req.n == 1 and not req.stream and req.tool_choice == "none"
    sp = req.sampling_params(default_max_tokens=1000)
    assert sp == SamplingParams(max_tokens=1000, temperature=1.0)
    assert req.sampling_params().max_tokens == SamplingParams().max_tokens


def test_chat_maps_sampling_fields():
    req = parse_chat_request(
        {
            "messages": USER,
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "min_p": 0.1,
            "presence_penalty": 1,
            "frequency_penalty": -1.5,
            "repetition_penalty": 1.1,
            "seed": 42,
            "stop": "###",
            "stop_token_ids": [7, 8],
            "logprobs": True,
            "top_logprobs": 3,
            "logit_bias": {"15": 5, "20": -100},
            "ignore_eos": True,
            "skip_special_tokens": False,
            "user": "ignored",
            "some_vendor_extra": {"x": 1},
            "n": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    sp = req.sampling_params(default_max_tokens=5)
    assert sp.max_tokens == 20  # max_completion_tokens wins
    assert sp.greedy and sp.top_p == 0.5 and sp.top_k == 40 and sp.min_p == 0.1
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (1.0, -1.5, 1.1)
    assert sp.seed == 42 and sp.stop == ["###"] and sp.stop_token_ids == [7, 8]
    assert sp.logprobs and sp.top_logprobs == 3
    assert sp.logit_bias == {15: 5.0, 20: -100.0}
    assert sp.ignore_eos and not sp.skip_special_tokens
    assert req.n == 3 and req.stream and req.include_usage
    assert parse_chat_request({"messages": USER, "max_tokens": 10}).sampling_params(5).max_tokens == 10


def test_chat_messages_normalised():
    req = parse_chat_request(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is"},
                        {"type": "image_url", "image_url": {"url": "file:///a.png", "detail": "low"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "thanks", "name": "bob"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "g", "description": "G"}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "chat_template_kwargs": {"enable_thinking": False},
            "response_format": {"type": "text"},
        }
    )
    m = req.messages
    assert m[0] == {"role": "system", "content": "be brief"}
    assert m[1]["content"][1] == {"type": "image_url", "image_url": {"url": "file:///a.png", "detail": "low"}}
    assert m[2]["content"] is None and m[2]["tool_calls"][0]["function"]["name"] == "f"
    assert m[3] == {"role": "tool", "content": "a\nb", "tool_call_id": "c1"}
    assert m[4]["name"] == "bob"
    assert req.image_urls == ["file:///a.png"]
    assert [t["function"]["name"] for t in req.tools] == ["f", "g"]
    assert req.tool_choice == {"type": "function", "function": {"name": "g"}}
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat_request({"messages": USER, "tools": req.tools}).tool_choice == "auto"


@pytest.mark.parametrize(("effort", "kwargs", "want"), [
    ("none", None, {"enable_thinking": False}),
    ("minimal", None, {"enable_thinking": False}),
    ("low", None, {}),
    ("medium", None, {}),
    ("high", None, {}),
    (None, None, {}),
    ("none", {"x": 1}, {"x": 1, "enable_thinking": False}),
    ("none", {"enable_thinking": True}, {"enable_thinking": True}),  # the explicit template variable wins
    ("high", {"enable_thinking": False}, {"enable_thinking": False}),
])
def test_reasoning_effort_sets_enable_thinking(effort: str | None, kwargs: dict[str, Any] | None,
                                               want: dict[str, Any]) -> None:
    body: dict[str, Any] = {"messages": USER, "reasoning_effort": effort}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    assert parse_chat_request(body).chat_template_kwargs == want


@pytest.mark.parametrize("effort", ["max", "", "NONE", 1, True])
def test_reasoning_effort_unknown_is_a_400_naming_the_values(effort: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": USER, "reasoning_effort": effort})
    assert e.value.status == 400 and e.value.param == "reasoning_effort"
    if isinstance(effort, str):
        assert "none, minimal, low, medium, high" in e.value.message


def test_completion_parsing():
    req = parse_completion_request({"model": "m", "prompt": "Once"})
    assert req.prompts == ["Once"]
    assert req.sampling_params(default_max_tokens=1000).max_tokens == 16  # OpenAI's default
    assert req.sampling_params(default_max_tokens=4).max_tokens == 4  # shortened by the context
    assert not req.sampling_params().logprobs
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    req = parse_completion_request(
        {"prompt": "x", "logprobs": 2, "echo": True, "max_tokens": 5, "suffix": None}
    )
    sp = req.sampling_params(100)
    assert sp.logprobs and sp.top_logprobs == 2 and sp.max_tokens == 5 and req.echo
    assert parse_completion_request({"prompt": "x", "logprobs": 0}).sampling_params().logprobs
    assert parse_completion_request({"prompt": "x", "best_of": 2, "n": 2}).n == 2


def test_generate_parsing():
    req = parse_generate_request(
        {
            "text": "hello",
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop": ["\n"],
                "logit_bias": {"3": 1},
            },
            "stream": True,
            "rid": "r1",
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
    )
    assert req.prompts == ["hello"] and not req.is_batch and req.rids == ["r1"] and req.stream
    sp = req.sampling_params(100)
    assert sp.max_tokens == 8 and sp.greedy and sp.stop == ["\n"] and sp.logit_bias == {3: 1.0}
    assert sp.logprobs and sp.top_logprobs == 2
    batch = parse_generate_request({"input_ids": [[1, 2], [3]], "rid": ["a", "b"]})
    assert batch.is_batch and batch.input_ids == [[1, 2], [3]] and batch.batch_size == 2
    assert batch.sampling_params(50).max_tokens == 50
    single = parse_generate_request({"input_ids": [1, 2]})
    assert not single.is_batch and single.prompts == [[1, 2]]
    assert parse_generate_request({"text": ["a"]}).is_batch


def test_sampling_params_errors_become_api_errors():
    req = parse_chat_request({"messages": USER})
    with pytest.raises(APIError) as info:
        req.sampling_params(default_max_tokens=0)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    req.top_logprobs = 99  # a value only SamplingParams.validate() catches
    with pytest.raises(APIError) as info:
        req.sampling_params(10)
    assert info.value.param == "top_logprobs"
    greq = parse_generate_request({"text": "x"})
    greq.top_p = 0.0
    with pytest.raises(APIError) as info:
        greq.sampling_params(10)
    assert info.value.param == "sampling_params.top_p"


def test_decode_json():
    assert decode_json(b'{"a": 1}') == {"a": 1}
    for bad in (b"{", b"\xff", b'{"a": NaN}', b"[" * 100000):
        with pytest.raises(APIError) as info:
            decode_json(bad)
        assert info.value.status == 400


def test_decode_json_takes_utf8_only():
    """RFC 8259 8.1: UTF-8 (a BOM is tolerated); UTF-16/32, which json.loads would sniff, are a 400."""
    assert decode_json('{"text": "héllo ☃"}'.encode()) == {"text": "héllo ☃"}
    assert decode_json(b"\xef\xbb\xbf" + b'{"a": 1}') == {"a": 1}
    for enc in ("utf-16", "utf-16-le", "utf-32"):
        with pytest.raises(APIError) as info:
            decode_json('{"a": 1}'.encode(enc))
        assert info.value.status == 400 and "UTF-8" in info.value.message


# ---------------------------------------------------------------------------------------------
# Parsing: bad inputs

M = {"messages": USER}
BAD_CHAT: list[tuple[Any, str | None]] = [
    ([], None),
    ("text", None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].image_url",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]},
        "messages[0].content[0].image_url.url",
    ),
    (
        {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
    ),
    ({**M, "model": 3}, "model"),
    ({**M, "stream": "yes"}, "stream"),
    ({**M, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**M, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**M, "n": 0}, "n"),
    ({**M, "n": MAX_N + 1}, "n"),
    ({**M, "max_tokens": -1}, "max_tokens"),
    ({**M, "max_tokens": 0}, "max_tokens"),
    ({**M, "max_tokens": 10**30}, "max_tokens"),
    ({**M, "max_tokens": 1.5}, "max_tokens"),
    ({**M, "max_completion_tokens": "8"}, "max_completion_tokens"),
    ({**M, "temperature": 2.5}, "temperature"),
    ({**M, "temperature": -0.1}, "temperature"),
    ({**M, "temperature": True}, "temperature"),
    ({**M, "temperature": float("nan")}, "temperature"),
    ({**M, "temperature": 10**400}, "temperature"),
    ({**M, "top_p": 0}, "top_p"),
    ({**M, "top_p": 1.5}, "top_p"),
    ({**M, "top_k": -2}, "top_k"),
    ({**M, "min_p": 2}, "min_p"),
    ({**M, "presence_penalty": 3}, "presence_penalty"),
    ({**M, "frequency_penalty": -2.01}, "frequency_penalty"),
    ({**M, "repetition_penalty": 0}, "repetition_penalty"),
    ({**M, "seed": "1"}, "seed"),
    ({**M, "seed": 2**70}, "seed"),
    ({**M, "stop": ""}, "stop"),
    ({**M, "stop": ["a", 1]}, "stop"),
    ({**M, "stop": {"a": 1}}, "stop"),
    ({**M, "stop": ["x"] * 65}, "stop"),
    ({**M, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({**M, "stop_token_ids": 5}, "stop_token_ids"),
    ({**M, "logprobs": 1}, "logprobs"),
    ({**M, "top_logprobs": 2}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**M, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**M, "logit_bias": {"-5": 1}}, "logit_bias"),
    ({**M, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**M, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({**M, "logit_bias": {"9" * 4400: 1}}, "logit_bias"),
    ({**M, "logit_bias": [1]}, "logit_bias"),
    ({**M, "ignore_eos": "no"}, "ignore_eos"),
    ({**M, "skip_special_tokens": 0}, "skip_special_tokens"),
    ({**M, "tools": {}}, "tools"),
    ({**M, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**M, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({**M, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    (
        {
            **M,
            "tools": [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
        },
        "tools[1].function.name",
    ),
    (
        {**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    ({**M, "tool_choice": "auto"}, "tool_choice"),
    ({**M, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            **M,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
    ),
    ({**M, "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
    ({**M, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({**M, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({**M, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**M, "response_format": {}}, "response_format.type"),
    ({**M, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.name"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({**M, "response_format": "text"}, "response_format"),
    ({**M, "modalities": ["text", "audio"]}, "modalities"),
    ({**M, "parallel_tool_calls": "x"}, "parallel_tool_calls"),
] + [({**M, key: {"x": 1}}, key) for key in UNSUPPORTED_CHAT_FIELDS]

P = {"prompt": "x"}
BAD_COMPLETION: list[tuple[Any, str | None]] = [
    (None, None),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1], [2**40]]}, "prompt[1][0]"),
    ({"prompt": [{"a": 1}]}, "prompt"),
    ({"prompt": ["a"] * 300}, "prompt"),
    ({**P, "suffix": "tail"}, "suffix"),
    ({**P, "logprobs": 6}, "logprobs"),
    ({**P, "logprobs": True}, "logprobs"),
    ({**P, "echo": "y"}, "echo"),
    ({**P, "best_of": 3}, "best_of"),
    ({**P, "n": 17}, "n"),
    ({"prompt": ["a"] * 100, "n": 3}, "n"),
    ({**P, "max_tokens": 0}, "max_tokens"),
    ({**P, "temperature": 3}, "temperature"),
    ({**P, "stop": [""]}, "stop"),
    ({**P, "stream_options": {}}, "stream_options"),
]

T = {"text": "x"}
BAD_GENERATE: list[tuple[Any, str | None]] = [
    (1, None),
    ({}, "text"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": ["a", None]}, "text[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": "1 2"}, "input_ids"),
    ({"input_ids": [1, [2]]}, "input_ids[1]"),
    ({"input_ids": [[1], 2]}, "input_ids[1]"),
    ({**T, "sampling_params": []}, "sampling_params"),
    ({**T, "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens"),
    ({**T, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({**T, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({**T, "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({**T, "sampling_params": {"top_k": "5"}}, "sampling_params.top_k"),
    ({**T, "sampling_params": {"stop": [3]}}, "sampling_params.stop"),
    ({**T, "sampling_params": {"stop_token_ids": [1.5]}}, "sampling_params.stop_token_ids[0]"),
    ({**T, "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
    ({**T, "sampling_params": {"seed": 1.5}}, "sampling_params.seed"),
    ({**T, "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
    ({**T, "stream": 1}, "stream"),
    ({**T, "rid": 5}, "rid"),
    ({**T, "rid": ""}, "rid"),
    ({**T, "rid": "r" * 300}, "rid"),
    ({**T, "rid": "a\nb"}, "rid"),  # a control character
    ({"text": ["a", "b"], "rid": "r"}, "rid"),
    ({"text": ["a", "b"], "rid": ["r", "r"]}, "rid"),
    ({**T, "return_logprob": "y"}, "return_logprob"),
    ({**T, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({**T, "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
]


def _expect_400(parse, body: Any, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse(body)
    e = info.value
    assert (e.status, e.param) == (400, param), e.message
    assert e.type == "invalid_request_error"
    if param is not None:
        assert param.split(".")[-1].split("[")[0] in e.message  # the message names the field
    assert len(e.message) < 400


@pytest.mark.parametrize(("body", "param"), BAD_CHAT, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_chat(body: Any, param: str | None) -> None:
    _expect_400(parse_chat_request, body, param)


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_completion(body: Any, param: str | None) -> None:
    _expect_400(parse_completion_request, body, param)


@pytest.mark.parametrize(("body", "param"), BAD_GENERATE, ids=lambda x: json.dumps(x, default=str)[:60])
def test_bad_generate(body: Any, param: str | None) -> None:
    _expect_400(parse_generate_request, body, param)


# ---------------------------------------------------------------------------------------------
# Fuzz: arbitrary JSON never raises anything but APIError. Bodies are either arbitrary JSON or
# built from valid field values with a few fields (anywhere in the tree) replaced by arbitrary JSON,
# so that the parsers' success paths and every check along them are reached.

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["text", "image_url", "function", "user", "assistant", "tool", "auto", "none", "1"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


nonempty = st.text(min_size=1, max_size=8)
token_ids = st.lists(st.integers(0, 1000), min_size=1, max_size=5)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": nonempty})}
    ),
)
tool_call = st.fixed_dictionaries(
    {
        "id": nonempty,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": nonempty, "arguments": st.just("{}")}),
    }
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.text(max_size=8) | st.lists(part, max_size=3),
        },
        optional={"name": nonempty},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none() | st.text(max_size=8)},
        optional={"tool_calls": st.lists(tool_call, max_size=2), "reasoning_content": st.text(max_size=8)},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.text(max_size=8), "tool_call_id": nonempty}
    ),
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.just("f")},
            optional={"description": st.text(), "parameters": st.just({"type": "object"})},
        ),
    }
)
SAMPLING = {
    "stop": nonempty | st.lists(nonempty, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
OPENAI_COMMON = {
    **SAMPLING,
    "model": st.text(max_size=8),
    "n": st.integers(1, MAX_N),
    "max_tokens": st.integers(1, 10**6),
    "user": json_values,
    "unknown_extra": json_values,
}
streaming = st.one_of(
    st.fixed_dictionaries({"stream": st.booleans()}),
    st.fixed_dictionaries(
        {"stream": st.just(True), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    ),
)
CHAT = {
    **OPENAI_COMMON,
    "max_completion_tokens": st.integers(1, 10**6),
    "logprobs": st.just(True),
    "top_logprobs": st.integers(0, 20),
    "tools": st.lists(tool, min_size=1, max_size=1),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]
    ),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "response_format": st.just({"type": "text"}),
    "parallel_tool_calls": st.booleans(),
}
COMPLETION = {**OPENAI_COMMON, "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": st.just("")}
GENERATE = {
    "return_logprob": st.just(True),
    "top_logprobs_num": st.integers(0, 20),
    "sampling_params": st.fixed_dictionaries(
        {}, optional={**SAMPLING, "max_new_tokens": st.integers(1, 10**6)}
    ),
}
ALL_KEYS = sorted({*CHAT, *COMPLETION, *GENERATE, "messages", "prompt", "text", "input_ids", "rid", "stream",
                   "stream_options", "best_of", *UNSUPPORTED_CHAT_FIELDS, *GENERATE_SAMPLING_KEYS})  # fmt: skip


def _locations(v: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    if isinstance(v, (dict, list)):
        for k in list(v) if isinstance(v, dict) else range(len(v)):
            out.append((v, k))
            _locations(v[k], out)
    return out


def _mutate(args: tuple[Any, list[tuple[int, str | None, Any]]]) -> Any:
    """Replace a value anywhere in the tree, or set a (possibly unsupported) top-level key."""
    body, mutations = args
    for pick, key, value in mutations:
        if key is not None and isinstance(body, dict):
            body[key] = value
            continue
        locs = _locations(body, [])
        if locs:
            container, k = locs[pick % len(locs)]
            container[k] = value
    return body


def _bodies(*parts: st.SearchStrategy) -> st.SearchStrategy:
    """Arbitrary JSON, or a valid body (the union of ``parts``) with 0-2 mutations."""
    valid = st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})
    mutation = st.tuples(st.integers(0, 10**6), st.none() | st.sampled_from(ALL_KEYS), json_values)
    return json_values | st.tuples(valid, st.lists(mutation, max_size=2)).map(_mutate)


CHAT_BODIES = _bodies(
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional=CHAT), streaming
)
COMPLETION_BODIES = _bodies(
    st.fixed_dictionaries(
        {
            "prompt": nonempty
            | st.lists(nonempty, min_size=1, max_size=3)
            | token_ids
            | st.lists(token_ids, min_size=1, max_size=2)
        },
        optional=COMPLETION,
    ),
    streaming,
)
GENERATE_BODIES = _bodies(
    st.one_of(
        st.fixed_dictionaries({"text": nonempty}, optional={"rid": nonempty}),
        st.fixed_dictionaries({"input_ids": token_ids}, optional={"rid": nonempty}),
        st.fixed_dictionaries(
            {"text": st.lists(nonempty, min_size=2, max_size=2)}, optional={"rid": st.just(["a", "b"])}
        ),
        st.fixed_dictionaries({"input_ids": st.lists(token_ids, min_size=1, max_size=3)}),
    ),
    st.fixed_dictionaries({}, optional=GENERATE),
    streaming,
)


def _never_crashes(parse, body: Any) -> bool:
    """Parse and map to SamplingParams; only APIError 400 may escape. True when it parsed."""
    try:
        req = parse(body)
    except APIError as e:
        assert e.status == 400 and isinstance(e.message, str) and len(e.message) < 1000
        json.dumps(e.to_dict())
        return False
    for default in (None, 0, 1, 4096):
        try:
            sp = req.sampling_params(default)
        except APIError as e:
            assert e.status == 400
            continue
        sp.validate()
        assert sp.max_tokens >= 1 and math.isfinite(sp.temperature)
    return True


FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    ("parse", "bodies"),
    [
        (parse_chat_request, CHAT_BODIES),
        (parse_completion_request, COMPLETION_BODIES),
        (parse_generate_request, GENERATE_BODIES),
    ],
    ids=["chat", "completion", "generate"],
)
def test_fuzz_parsers(parse, bodies: st.SearchStrategy) -> None:
    parsed = []

    @FUZZ
    @given(bodies)
    def run(body: Any) -> None:
        parsed.append(_never_crashes(parse, body))

    run()
    assert set(SAMPLING) | {"max_new_tokens"} == set(GENERATE_SAMPLING_KEYS)
    assert any(parsed), "the fuzzer never produced a valid request: its strategies are off"
