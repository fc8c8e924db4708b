"""A KV cache smaller than the model's context (a small GPU): a request that gives no output limit
gets what the cache leaves after its prompt (not a refusal for a max_tokens it never sent), and one
that asks for more than the cache holds is refused naming the field it sent and the cache's size."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test-0123456789abcdef"
CONTEXT = 128
KV_TOKENS = 48
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


@pytest.fixture(scope="module")
def d(tiny_model: Any) -> Any:
    daemon = start_daemon(tiny_model, "--model.context_length", str(CONTEXT), "--scheduler.max_total_tokens",
                          str(KV_TOKENS), api_key=KEY)
    yield daemon
    stop_and_check(daemon)


@pytest.fixture(scope="module")
def h(d: Any) -> Any:
    with d.http(timeout=60) as client:
        yield client


def test_status_reports_the_smaller_cache(d: Any) -> None:
    with d.uds_http() as admin:
        model = admin.get("/admin/status").json()["model"]
    assert model["context_length"] == CONTEXT and model["kv_cache_tokens"] == KV_TOKENS, model


@pytest.mark.parametrize("stream", [False, True])
def test_no_limit_given_gets_what_the_cache_leaves(h: Any, stream: bool) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = h.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    else:
        usage = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] < KV_TOKENS and usage["prompt_tokens"] + usage["completion_tokens"] == KV_TOKENS, usage


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_limit_over_the_cache_names_the_field_and_the_cache(h: Any, field: str) -> None:
    r = h.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], field: KV_TOKENS + 20})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "KV cache" in err["message"] and str(KV_TOKENS) in err["message"], err
    r = h.post(COMPL, json={"prompt": list(range(1000, 1010)), "max_tokens": KV_TOKENS})  # token ids: checked in main
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and str(KV_TOKENS) in err["message"], err


def rejected_total(h: Any) -> float:
    line = [x for x in h.get("/metrics").text.splitlines()
            if x.startswith("mllmd_request_failure_total{") and 'reason="rejected"' in x]
    assert len(line) == 1, line
    return float(line[0].rpartition(" ")[2])


def test_a_prompt_over_the_cache_names_the_prompt(h: Any) -> None:
    before = rejected_total(h)
    for prompt in (list(range(1000, 1000 + KV_TOKENS + 5)), "hello " * (KV_TOKENS + 5)):
        r = h.post(COMPL, json={"prompt": prompt, "max_tokens": 1, "n": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and "KV cache" in err["message"], err
        assert str(KV_TOKENS) in err["message"], err
    # the text prompt was refused by the tokenizer worker (both choices count as rejected); the token
    # ids were refused in the main process before anything was submitted
    assert rejected_total(h) == before + 2
