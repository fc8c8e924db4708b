"""A hypothesis fuzz of the OpenAI and native routes (the Responses API too): valid bodies, bodies with
one field corrupted, noise, and values nested up to 1,000 levels anywhere (inside tools, template kwargs,
content, stop strings, sampling params, prompts, unknown fields, the top level; on /v1/responses inside
input items and parts, function_call arguments, flat tools' parameters, text.format.schema and
metadata). Every answer is a 2xx or a 4xx in OpenAI's error shape, nothing hangs, and afterwards the
daemon is healthy, idle (nothing held for any request in any process) and no worker was restarted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon.conftest import start_daemon, stop_and_check
from tests.daemon.test_bad_input import CHAT, COMPL, GEN, RESP, _fuzz_strategies, check_answer

from .helpers import wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

KEY = "sk-fuzz-0123456789abcdef"
EXAMPLES = int(os.environ.get("MLLMD_HARDENING_FUZZ_EXAMPLES", "1000"))
MAX_DEPTH = 1000
PLACEHOLDER = "\u2063deep:"  # a string no strategy produces, replaced by the nested JSON text


def deep_text(depth: int, kind: str) -> str:
    """JSON text nested `depth` levels (written directly: json.dumps would hit the recursion limit)."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    if kind == "dict":
        return '{"a": ' * depth + "1" + "}" * depth
    return '{"a": [' * (depth // 2) + '"x"' + "]}" * (depth // 2)


def render(body: Any) -> bytes:
    text = json.dumps(body)
    while PLACEHOLDER in text:
        i = text.index('"' + PLACEHOLDER)
        j = text.index('"', i + 1)
        depth, kind = text[i + 1 + len(PLACEHOLDER): j].split(":")
        text = text[:i] + deep_text(int(depth), kind) + text[j + 1:]
    return text.encode()


def strategies() -> Any:
    from hypothesis import strategies as st

    base = _fuzz_strategies()
    deep = st.builds(lambda d, k: f"{PLACEHOLDER}{d}:{k}", st.integers(1, MAX_DEPTH),
                     st.sampled_from(["list", "dict", "mixed"]))

    @st.composite
    def nested(draw: Any) -> tuple[str, Any]:
        path, body = draw(base)
        where = draw(st.sampled_from(["tool", "template", "content", "stop", "logit_bias", "prompt", "sampling",
                                      "unknown", "root", "tool_call", "responses"]))
        value = draw(deep)
        if where == "root":
            return path, value
        if not isinstance(body, dict):
            body = {}
        if path == RESP and where in ("tool", "content", "tool_call", "responses"):
            body.update(draw(responses_nested(value)))
        elif where == "tool":
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"p": value}}}]
        elif where == "template":
            body["chat_template_kwargs"] = {"x": value}
        elif where == "content":
            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": value}]}]
        elif where == "tool_call":
            body["messages"] = [{"role": "assistant", "tool_calls": [
                {"id": "c", "function": {"name": "f", "arguments": {"a": value}}}]}]
        elif where == "stop":
            body["stop"] = [value]
        elif where == "logit_bias":
            body["logit_bias"] = {"5": value}
        elif where == "prompt":
            body["prompt" if path != GEN else "input_ids"] = [value]
        elif where == "sampling":
            body["sampling_params"] = {"stop": value}
        else:
            body[draw(st.text(min_size=1, max_size=8))] = value
        return path, body

    def responses_nested(value: Any) -> Any:
        """Responses fields holding `value`: in an input item or part, a call's arguments, a flat tool's
        parameters, the text format's schema, metadata."""
        call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": value}
        return st.sampled_from([
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": value}]}]},
            {"input": [{"role": "user", "content": "hi"}, {"type": "message", "role": "user", "content": value}]},
            {"input": [{"role": "user", "content": "hi"}, call]},
            {"input": [{"role": "user", "content": "hi"}, {**call, "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c", "output": [value]}]},
            {"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "content": [
                {"type": "reasoning_text", "text": value}]}, {"role": "assistant", "content": "ok"}]},
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": value}}]},
            {"text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object", "x": value}}}},
            {"metadata": {"k": value}}, {"include": [value]}, {"reasoning": {"effort": value}},
            {"tool_choice": {"type": "function", "name": value}},
        ])

    routes = st.sampled_from([CHAT, COMPL, GEN, RESP, "/abort_request"])
    renamed = st.tuples(routes, base.map(lambda c: c[1]))
    return st.one_of(base, nested(), renamed)


def test_fuzz_no_5xx_no_hang(tiny_model: Path) -> None:
    from hypothesis import HealthCheck, given, settings

    d = start_daemon(tiny_model, "--server.max_request_bytes", "200000", "--model.context_length", "128",
                     api_key=KEY)
    seen: dict[int, int] = {}
    routes: dict[str, int] = {}
    try:
        pids = d.workers()
        with httpx.Client(base_url=d.base_url, timeout=httpx.Timeout(60.0), headers=d.headers()) as h:

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much, HealthCheck.large_base_example])
            @given(strategies())
            def check(case: tuple[str, Any]) -> None:
                path, body = case
                payload = render(body)
                try:
                    with h.stream("POST", path, content=payload, headers={"Content-Type": "application/json"}) as r:
                        raw = r.read()
                except httpx.TimeoutException:
                    raise AssertionError(f"no answer within 60 s: {path} {payload[:300]!r}") from None
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                key = f"{path} {r.status_code}"
                routes[key] = routes.get(key, 0) + 1
                assert r.status_code < 500, (path, payload[:300], r.status_code, raw[:300])
                check_answer(path, r.status_code, r.headers["content-type"], raw, payload[:300])

            t = time.monotonic()
            check()
            took = time.monotonic() - t
            total = sum(seen.values())
            print(f"fuzz: {total} requests in {took:.1f} s, statuses {dict(sorted(seen.items()))}, "
                  f"by route {dict(sorted(routes.items()))}")
            assert total >= EXAMPLES and seen.get(200, 0) >= 50, seen
            responses = {k: v for k, v in routes.items() if k.startswith(RESP + " ")}
            assert sum(responses.values()) >= EXAMPLES // 10 and responses.get(f"{RESP} 200"), routes
            assert not any(code >= 500 for code in seen)
            assert d.health()[0] == 200
            idle = wait_idle(d)
            print(f"fuzz: afterwards in flight and held per process: {idle}")
            assert d.workers() == pids, "a worker was restarted during fuzzing"
            r = h.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        stop_and_check(d)
