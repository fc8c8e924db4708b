"""Bad input: every malformed, mistyped, out-of-range, oversized or unauthenticated request gets a
4xx in the OpenAI shape; a hypothesis fuzz pass finds no 5xx, and the daemon stays healthy.

The module's daemon has an API key, a 100 kB body limit and a 128-token context (which also bounds
how long any request the fuzzer gets through can run).
"""

from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

import httpx
import pytest

from .conftest import start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-qwen3"
KEY = "sk-test-0123456789abcdef"
CONTEXT = 128
LIMIT = 100_000
MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
GEN = "/generate"
RESP = "/v1/responses"


@pytest.fixture(scope="module")
def d(tiny_model: Any) -> Any:
    daemon = start_daemon(tiny_model, "--server.max_request_bytes", str(LIMIT), "--model.context_length",
                          str(CONTEXT), api_key=KEY)
    yield daemon
    stop_and_check(daemon)


@pytest.fixture(scope="module")
def h(d: Any) -> Any:
    with d.http(timeout=60) as client:
        yield client


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...], param: str | None = "*") -> dict[str, Any]:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "*":
        assert err["param"] == param, err
    return err


# ---- authentication --------------------------------------------------------------------------
ROUTES = [("GET", "/v1/models", None), ("POST", CHAT, {"messages": MSG, "max_tokens": 1}),
          ("POST", COMPL, {"prompt": "hi", "max_tokens": 1}),
          ("POST", GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
          ("POST", RESP, {"input": "hi", "max_output_tokens": 1}),
          ("POST", "/abort_request", {"rid": "x"})]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[p for _, p, _ in ROUTES])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer", KEY, f"Bearer {KEY}x"])
def test_missing_or_wrong_key_is_401(d: Any, method: str, path: str, body: Any, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, d.base_url + path, json=body, headers=headers, timeout=30)
    err = assert_openai_error(r, 401)
    assert err["code"] == "invalid_api_key"
    assert KEY not in r.text and "wrong-key" not in r.text
    assert r.headers.get("www-authenticate", "").lower().startswith("bearer")


def test_unauthenticated_garbage_is_401_not_400(d: Any) -> None:
    r = httpx.post(d.base_url + CHAT, content=b"{not json", timeout=30)
    assert_openai_error(r, 401)


def test_key_accepted_and_health_open(d: Any, h: Any) -> None:
    assert httpx.get(d.base_url + "/health", timeout=10).status_code == 200
    for method, path, body in ROUTES[:5]:
        r = h.request(method, path, json=body)
        assert r.status_code == 200, (path, r.text)
    r = httpx.get(d.base_url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=10)
    assert r.status_code == 200  # the scheme is case-insensitive
    # and over the Unix socket the key is required too
    with httpx.Client(transport=httpx.HTTPTransport(uds=d.uds), base_url="http://localhost", timeout=10) as u:
        assert u.get("/health").status_code == 200
        assert_openai_error(u.get("/v1/models"), 401)


# ---- malformed bodies ------------------------------------------------------------------------
RAW_BODIES = {
    "truncated": b'{"messages": [{"role": "user", "content": "hi"}',
    "empty": b"",
    "not-json": b"hello",
    "array": b'[{"messages": []}]',
    "string": b'"hello"',
    "null": b"null",
    "nan": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    "infinity": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
    "invalid-utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}]}',
    "latin1": '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),
    "deep-nesting": b"[" * 50_000 + b"]" * 50_000,
    "trailing-garbage": b'{"messages": [{"role": "user", "content": "hi"}]} x',
}


@pytest.mark.parametrize("path", [CHAT, COMPL, GEN, RESP])
@pytest.mark.parametrize("name", sorted(RAW_BODIES))
def test_malformed_body_is_400(h: Any, path: str, name: str) -> None:
    r = h.post(path, content=RAW_BODIES[name], headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400)


# ---- wrong types and values ------------------------------------------------------------------
BAD_FIELDS: list[tuple[str, dict[str, Any], str | None]] = [
    # (path, body, expected param)
    (CHAT, {}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    (CHAT, {"messages": MSG, "max_tokens": "10"}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**30}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 1.5}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 1e300 * 10}, None),  # json.dumps gives Infinity: bad JSON
    (CHAT, {"messages": MSG, "temperature": True}, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p"),
    (CHAT, {"messages": MSG, "top_k": -7}, "top_k"),
    (CHAT, {"messages": MSG, "min_p": 2}, "min_p"),
    (CHAT, {"messages": MSG, "presence_penalty": 9}, "presence_penalty"),
    (CHAT, {"messages": MSG, "frequency_penalty": -9}, "frequency_penalty"),
    (CHAT, {"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"messages": MSG, "n": 0}, "n"),
    (CHAT, {"messages": MSG, "n": 10**6}, "n"),
    (CHAT, {"messages": MSG, "stream": "yes"}, "stream"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 500}, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSG, "stop": 5}, "stop"),
    (CHAT, {"messages": MSG, "stop": [""]}, "stop"),
    (CHAT, {"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 1000}}, "logit_bias"),
    (CHAT, {"messages": MSG, "seed": "x"}, "seed"),
    (CHAT, {"messages": MSG, "seed": 10**40}, "seed"),
    (CHAT, {"messages": MSG, "tools": "get_weather"}, "tools"),
    (CHAT, {"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type"),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    (CHAT, {"messages": MSG, "model": 5}, "model"),
    (COMPL, {}, "prompt"),
    (COMPL, {"prompt": 5}, "prompt"),
    (COMPL, {"prompt": []}, "prompt"),
    (COMPL, {"prompt": ""}, "prompt"),
    (COMPL, {"prompt": [-1]}, "prompt[0]"),
    (COMPL, {"prompt": [1, "a"]}, "prompt[1]"),
    (COMPL, {"prompt": "hi", "logprobs": 10}, "logprobs"),
    (COMPL, {"prompt": "hi", "echo": "x"}, "echo"),
    (COMPL, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (COMPL, {"prompt": "hi", "best_of": 3}, "best_of"),
    (COMPL, {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    (GEN, {}, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, "text"),
    (GEN, {"text": 5}, "text"),
    (GEN, {"input_ids": "abc"}, "input_ids"),
    (GEN, {"text": "hi", "sampling_params": "x"}, "sampling_params"),
    (GEN, {"text": "hi", "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens"),
    (GEN, {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    (GEN, {"text": "hi", "top_logprobs_num": 3}, "top_logprobs_num"),
    # the Responses API: its own fields, and chat's checks named by the Responses field they came from
    (RESP, {}, "input"),
    (RESP, {"input": None, "instructions": "x"}, "input"),
    (RESP, {"input": {"role": "user", "content": "hi"}}, "input"),
    (RESP, {"input": [None]}, "input[0]"),
    (RESP, {"input": [[{"role": "user", "content": "hi"}]]}, "input[0]"),
    (RESP, {"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    (RESP, {"input": [{"role": "user", "content": {"type": "input_text", "text": "hi"}}]}, "input[0].content"),
    (RESP, {"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]}, "input[0].content[0].text"),
    (RESP, {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": [1]}]}, "input[0].arguments"),
    (RESP, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input"),  # a model without a vision tower
    (RESP, {"input": "hi", "instructions": ["x"]}, "instructions"),
    (RESP, {"input": "hi", "max_output_tokens": 10**30}, "max_output_tokens"),
    (RESP, {"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    (RESP, {"input": "hi", "top_logprobs": 10**30}, "top_logprobs"),
    (RESP, {"input": "hi", "temperature": None, "top_p": [1]}, "top_p"),
    (RESP, {"input": "hi", "tools": {"name": "f"}}, "tools"),
    (RESP, {"input": "hi", "tools": [{"type": "function", "name": "f" * 50_000}]}, "tools[0].name"),
    (RESP, {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools[0].parameters"),
    (RESP, {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                                       "name": "g"}}, "tool_choice.name"),
    (RESP, {"input": "hi", "tool_choice": []}, "tool_choice"),
    (RESP, {"input": "hi", "text": {"format": [1]}}, "text.format"),
    (RESP, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "t", "schema": [1]}}}, "text.format.schema"),
    (RESP, {"input": "hi", "reasoning": "high"}, "reasoning"),
    (RESP, {"input": "hi", "include": {"message.output_text.logprobs": True}}, "include"),
    (RESP, {"input": "hi", "include": [None, 5]}, "include[0]"),
    (RESP, {"input": "hi", "metadata": {"k": {"nested": "v"}}}, "metadata.k"),
    (RESP, {"input": "hi", "metadata": ["k"]}, "metadata"),
    (RESP, {"input": "hi", "stream": "true"}, "stream"),
    (RESP, {"input": "hi", "store": 1}, "store"),
    (RESP, {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
]


@pytest.mark.parametrize("path,body,param", BAD_FIELDS, ids=[f"{p}:{json.dumps(b)[:60]}" for p, b, _ in BAD_FIELDS])
def test_bad_field_is_400(h: Any, path: str, body: dict[str, Any], param: str | None) -> None:
    err = assert_openai_error(h.post(path, content=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}), 400)
    if param is not None:
        assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_values_known_only_to_the_workers_are_400(h: Any, stream: bool) -> None:
    """Checks made after tokenization (context room, vocabulary) are still HTTP 400s, even when
    streaming: an error known before the first token is never a 200 followed by an SSE error."""
    cases = [
        (CHAT, {"messages": MSG, "max_tokens": 10**9}, ["1000000000", str(CONTEXT)], "max_tokens"),
        # the field named is the one the client sent (the OpenAI SDK sends max_completion_tokens)
        (CHAT, {"messages": MSG, "max_completion_tokens": 10**9}, ["max_completion_tokens (1000000000)"],
         "max_completion_tokens"),
        (COMPL, {"prompt": [1, 2], "max_tokens": CONTEXT}, [str(CONTEXT + 2)], "max_tokens"),  # no tokenizer hop
        (COMPL, {"prompt": [10**9]}, ["1000000000"], "prompt"),  # a token id outside the vocabulary
        (COMPL, {"prompt": "hi", "logit_bias": {str(10**8): 5}}, [], "logit_bias"),
        (COMPL, {"prompt": [1, 2], "logit_bias": {str(10**8): 5}}, [], "logit_bias"),  # ids: no tokenizer hop
        (CHAT, {"messages": MSG, "stop_token_ids": [10**8]}, [], "stop_token_ids"),
        (GEN, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT}}, [str(CONTEXT)], "*"),
        (RESP, {"input": "hi", "max_output_tokens": 10**9}, ["max_output_tokens (1000000000)", str(CONTEXT)],
         "max_output_tokens"),
        (RESP, {"input": "hi", "stop_token_ids": [10**8]}, [], "stop_token_ids"),
    ]
    for path, body, numbers, param in cases:
        r = h.post(path, json={**body, "stream": stream})
        err = assert_openai_error(r, 400, param)
        for n in numbers:
            assert n in err["message"], (path, body, err)


@pytest.mark.parametrize("stream", [False, True])
def test_over_long_prompt_is_400_naming_both_numbers(h: Any, tokenizer: Any, stream: bool) -> None:
    text = "hello " * 300
    n_prompt = len(tokenizer(text)["input_ids"])
    assert n_prompt > CONTEXT
    r = h.post(COMPL, json={"prompt": text, "stream": stream})
    err = assert_openai_error(r, 400)
    assert str(n_prompt) in err["message"] and str(CONTEXT) in err["message"], err
    r = h.post(COMPL, json={"prompt": list(range(1000, 1000 + CONTEXT + 5)), "stream": stream})
    err = assert_openai_error(r, 400)
    assert str(CONTEXT + 5) in err["message"] and str(CONTEXT) in err["message"], err
    messages = [{"role": "user", "content": text}]
    n_chat = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    r = h.post(CHAT, json={"messages": messages, "stream": stream})
    err = assert_openai_error(r, 400)
    assert str(CONTEXT) in err["message"] and n_chat > 0
    r = h.post(GEN, json={"text": text, "stream": stream})
    err = assert_openai_error(r, 400)
    assert str(n_prompt) in err["message"] and str(CONTEXT) in err["message"], err
    err = assert_openai_error(h.post(RESP, json={"input": messages, "stream": stream}), 400, "input")
    assert str(CONTEXT) in err["message"]


def test_unknown_model_is_404(h: Any) -> None:
    for path, body in ((CHAT, {"messages": MSG}), (COMPL, {"prompt": "hi"}), (RESP, {"input": "hi"})):
        for stream in (False, True):
            err = assert_openai_error(h.post(path, json={**body, "model": "gpt-4o", "stream": stream}), 404, "model")
            assert err["code"] == "model_not_found" and "gpt-4o" in err["message"]


def test_bodies_held_open_are_bounded_in_all(d: Any, h: Any) -> None:
    """Before: 100 connections each holding an 8 MB body a byte short grew the main process by 800 MB
    for body_timeout (1,000 connections: 8 GB). Now the bodies arriving at once hold at most 8 times
    server.max_request_bytes; past that a 503, and once they are gone requests are served again."""
    import socket
    import time

    from mllmd.daemon.http_common import BODIES_IN_FLIGHT

    size = LIMIT - 10
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {size}\r\n\r\n").encode()
    held = []
    try:
        for _ in range(BODIES_IN_FLIGHT):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
            s.sendall(head + b" " * (size - 1))  # a byte short: the body stays open
            held.append(s)
        deadline = time.monotonic() + 60
        with d.uds_http() as admin:  # until the server has read the held bodies (it reads them as they come)
            while (conns := admin.get("/admin/status").json()["connections"])["body_bytes_arriving"] < \
                    BODIES_IN_FLIGHT * (size - 1) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert conns["body_bytes_arriving"] == BODIES_IN_FLIGHT * (size - 1) == conns["body_bytes_limit"] - 88, conns
        r = h.post(CHAT, content=b" " * size, headers={"Content-Type": "application/json"})
        err = assert_openai_error(r, 503)
        assert "bodies" in err["message"] and "retry-after" in r.headers
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 20
    while (r := h.post(CHAT, json={"messages": MSG, "max_tokens": 1})).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_oversized_body_is_413(h: Any) -> None:
    big = {"messages": [{"role": "user", "content": "x" * (LIMIT + 10)}]}
    for path in (CHAT, COMPL, GEN, RESP):
        assert_openai_error(h.post(path, json=big), 413)

    def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1000 + 5):
            yield b"y" * 1000
        yield b'"}'

    r = h.post(COMPL, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_openai_error(r, 413)
    # just under the limit is fine (and then a normal 400/200 answer)
    ok = h.post(COMPL, json={"prompt": "hi " + " " * (LIMIT - 100), "max_tokens": 1})
    assert ok.status_code in (200, 400), ok.text


def test_unknown_route_and_method(h: Any) -> None:
    assert_openai_error(h.get("/v1/nothing"), 404)
    assert_openai_error(h.get(CHAT), 405)
    assert_openai_error(h.delete("/v1/models"), 405)


def test_healthy_after_bad_input(d: Any, h: Any) -> None:
    code, body = d.health()
    assert code == 200, body
    r = h.post(CHAT, json={"messages": MSG, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- fuzzing ---------------------------------------------------------------------------------
VOCAB = 151_936


def _fuzz_strategies() -> Any:
    """(path, body) documents: valid requests, valid requests with one field corrupted, and noise."""
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12), st.sampled_from([0, 1, -1, 2, 5, 16, 127, 128, 129, 2**31, 2**63, 10**9, 0.5, -0.5,
                                               1e9, "", "auto", "none", "user", "text", VOCAB, VOCAB - 1]),
    )
    anything = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                            max_size=3), max_leaves=8)
    token = st.integers(0, VOCAB - 1)
    words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": words})
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "lookup"])},
        optional={"parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}})})})
    sampling = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 100),
        "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.1, 2), "seed": st.integers(0, 2**63),
        "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(token, max_size=3), "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(token.map(str), st.floats(-100, 100), max_size=3),
        "skip_special_tokens": st.booleans(),
    }
    openai_common = {**sampling, "max_tokens": st.integers(1, 24), "n": st.integers(1, 3), "user": words,
                     "model": st.just(MODEL), "stream": st.booleans(),
                     "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
    chat = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional={
        **openai_common, "max_completion_tokens": st.integers(1, 24), "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5), "tools": st.lists(tool, min_size=1, max_size=2, unique_by=lambda t:
                                                               t["function"]["name"]),
        "tool_choice": st.sampled_from(["none", "auto", "required"]), "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    })
    completion = st.fixed_dictionaries({"prompt": words | st.lists(token, min_size=1, max_size=6)}, optional={
        **openai_common, "echo": st.booleans(), "logprobs": st.integers(0, 5)})
    generate = st.fixed_dictionaries({}, optional={
        "sampling_params": st.fixed_dictionaries({}, optional={**sampling, "max_new_tokens": st.integers(1, 24)}),
        "stream": st.booleans(), "return_logprob": st.booleans(), "top_logprobs_num": st.integers(0, 5),
    }).flatmap(lambda g: st.one_of(st.fixed_dictionaries({"text": words}), st.fixed_dictionaries(
        {"input_ids": st.lists(token, min_size=1, max_size=6)})).map(lambda p: {**g, **p}))
    responses = _responses_strategy(st, words, sampling)
    valid = st.one_of(st.tuples(st.just(CHAT), chat), st.tuples(st.just(COMPL), completion),
                      st.tuples(st.just(GEN), generate), st.tuples(st.just(RESP), responses))

    @st.composite
    def corrupted(draw: Any) -> tuple[str, Any]:
        path, body = draw(valid)
        keys = sorted(set(body) | set(openai_common) | {"messages", "prompt", "text", "input_ids", "sampling_params",
                                                          "logprobs", "top_logprobs", "tools", "tool_choice"}
                      | (set(RESPONSES_KEYS) if path == RESP else set()))
        key = draw(st.sampled_from(keys) | st.text(max_size=8))
        target = body
        if path == GEN and isinstance(body.get("sampling_params"), dict) and draw(st.booleans()):
            target = body["sampling_params"]
        target[key] = draw(anything)
        return path, body

    @st.composite
    def corrupted_inside(draw: Any) -> tuple[str, Any]:
        """A valid body with one value anywhere inside it (an input item's field, a part, a tool's
        name, a format's schema) replaced."""
        path, shared = draw(valid)
        body = copy.deepcopy(shared)  # strategies hand out the same objects (st.just) again: not these
        parent: Any = body
        key: Any = draw(st.sampled_from(sorted(body))) if body else "x"
        while isinstance(parent.get(key) if isinstance(parent, dict) else parent[key], (dict, list)):
            child = parent[key]
            if not child or draw(st.integers(0, 3)) == 0:
                break
            parent, key = child, draw(st.sampled_from(sorted(child) if isinstance(child, dict) else range(len(child))))
        parent[key] = draw(anything)
        return path, body

    noise = st.tuples(st.sampled_from([CHAT, COMPL, GEN, RESP]), anything)
    return st.one_of(valid, corrupted(), corrupted_inside(), noise)


RESPONSES_KEYS = ("input", "instructions", "tools", "tool_choice", "text", "reasoning", "include", "top_logprobs",
                  "max_output_tokens", "metadata", "store", "background", "truncation", "user", "parallel_tool_calls")


def _responses_strategy(st: Any, words: Any, sampling: dict[str, Any]) -> Any:
    """Valid /v1/responses bodies: string or item input (messages with text and image parts, function
    calls and their outputs, reasoning items), flat tools, every format, effort, include and metadata."""
    text_part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": words})
    image_part = st.fixed_dictionaries({"type": st.just("input_image"), "image_url": st.sampled_from(
        ["data:image/png;base64,iVBORw0KGgo=", "data:text/plain;base64,aGk=", "file:///etc/passwd"])},
        optional={"detail": st.sampled_from(["auto", "low", "high", "original"])})
    content = words | st.lists(text_part, min_size=1, max_size=3)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                                     "content": content}, optional={"type": st.just("message")})
    user_image = st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(text_part | image_part,
                                                                                     min_size=1, max_size=2)})
    call_id = st.sampled_from(["call_1", "call_2"])
    call = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": call_id,
                                  "name": st.sampled_from(["get_weather", "lookup"]),
                                  "arguments": st.sampled_from(['{"city": "Paris"}', "{}", "not json", "[1, 2]"])})
    output = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": call_id,
                                    "output": content})
    reasoning = st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])}, optional={
        "content": st.lists(st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": words}), max_size=2)})
    loose = st.lists(st.one_of(message, message, user_image, call, output, reasoning), min_size=1, max_size=5)
    round_trip = st.tuples(words, call, content, words).map(lambda t: [  # a call, then its output
        {"role": "user", "content": t[0]}, t[1], {"type": "function_call_output", "call_id": t[1]["call_id"],
                                                  "output": t[2]}, {"role": "user", "content": t[3]}])
    items = loose | round_trip
    tool = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["get_weather", "lookup"])},
                                 optional={"description": words, "strict": st.booleans(), "parameters": st.just(
                                     {"type": "object", "properties": {"city": {"type": "string"}}})})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = st.sampled_from([{"type": "text"}, {"type": "json_object"},
                           {"type": "json_schema", "name": "t", "schema": schema, "strict": True}])
    return st.fixed_dictionaries({"input": words | items}, optional={
        **sampling, "model": st.just(MODEL), "max_output_tokens": st.integers(1, 24), "instructions": words,
        "stream": st.booleans(), "tools": st.lists(tool, min_size=1, max_size=2, unique_by=lambda t: t["name"]),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "get_weather"}]),
        "parallel_tool_calls": st.booleans(), "text": st.fixed_dictionaries({"format": fmt}),
        "reasoning": st.fixed_dictionaries({}, optional={
            "effort": st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh"]),
            "summary": st.sampled_from(["auto", "concise", "detailed"])}),
        "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                            max_size=2),
        "top_logprobs": st.integers(0, 5), "store": st.booleans(), "truncation": st.sampled_from(["auto", "disabled"]),
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3), "user": words,
        "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    })


def check_answer(path: str, status: int, content_type: str, raw: bytes, body: Any) -> None:
    """A fuzzed request's answer: a 4xx in OpenAI's error shape, or a whole reply: a JSON body, or a
    stream that ended well ([DONE]; on /v1/responses, which has none, response.completed or
    response.incomplete, numbered from 0, no response.failed)."""
    if status != 200:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (path, body, err)
        return
    if not content_type.startswith("text/event-stream"):
        reply = json.loads(raw)
        if path == RESP:
            assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete"), reply
        return
    events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    if path == RESP:
        parsed = [json.loads(e) for e in events]
        kinds = [e["type"] for e in parsed]
        assert kinds and kinds[-1] in ("response.completed", "response.incomplete"), (body, kinds[-3:])
        assert "response.failed" not in kinds and "error" not in kinds, (body, parsed[-1])
        assert [e["sequence_number"] for e in parsed] == list(range(len(parsed))), body
        return
    assert events and events[-1] == "[DONE]", (path, body, events[-3:])
    for e in events[:-1]:
        assert "error" not in json.loads(e), (path, body, e)


@pytest.mark.slow
def test_fuzz_no_5xx(d: Any, h: Any) -> None:
    from hypothesis import HealthCheck, given, settings

    pids_before = d.workers()
    seen: dict[int, int] = {}

    @settings(max_examples=int(os.environ.get("MLLMD_FUZZ_EXAMPLES", "150")), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(_fuzz_strategies())
    def check(case: tuple[str, Any]) -> None:
        path, body = case
        payload = json.dumps(body).encode()
        with h.stream("POST", path, content=payload, headers={"Content-Type": "application/json"}) as r:
            raw = r.read()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, raw[:500])
        check_answer(path, r.status_code, r.headers["content-type"], raw, body)

    t = time.monotonic()
    check()
    print(f"fuzz: {sum(seen.values())} requests in {time.monotonic() - t:.1f} s, statuses {seen}")
    assert seen.get(200, 0) >= 20, f"too few requests got through: {seen}"
    code, body = d.health()
    assert code == 200, body
    assert d.workers() == pids_before, "a worker was restarted during fuzzing"
    r = h.post(CHAT, json={"messages": MSG, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
