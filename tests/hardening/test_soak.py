"""A 10,000-request soak: streams, collected requests, n > 1, stop strings, client disconnects
mid-stream and mid-collect, admin aborts, refused requests, on the chat, completions, native and
Responses routes, 16 at a time. Afterwards nothing is held
for any request in any process, the KV cache holds nothing but the evictable prefix cache, and every
process's RSS is within 5% of where it was after a warm-up of the same mix."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from mllmd.workers.scheduler_worker import IDLE_TRIM_AFTER
from tests.daemon.conftest import CLIENT_LIMITS, start_daemon, stop_and_check

from .helpers import admin, rss_mib, status, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REQUESTS = int(os.environ.get("MLLMD_HARDENING_SOAK_REQUESTS", "10000"))
WARMUP = max(500, REQUESTS // 10)
CONCURRENCY = 16
MSG = [{"role": "user", "content": "Say something."}]
KINDS = ["chat", "chat_stream", "completion_n2", "stop_strings", "disconnect_stream", "disconnect_collect",
         "admin_abort", "refused", "generate", "chat_n3_stream", "responses", "responses_stream",
         "responses_disconnect", "responses_refused"]
WEIGHTS = [20, 20, 10, 10, 10, 5, 5, 10, 5, 5, 8, 8, 8, 4]
RESP = "/v1/responses"
RESPONSES_REFUSED = [
    {"input": []}, {"input": "hi", "temperature": 9}, {"input": "hi", "max_output_tokens": 10**6},
    {"input": "hi", "stop": "x" * 2000}, {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
    {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
]


async def one_responses(kind: str, h: httpx.AsyncClient, rng: random.Random) -> str:
    """The Responses kinds of `one`."""
    tokens = rng.randint(1, 6)
    if kind == "responses":
        r = await h.post(RESP, json={"input": MSG, "max_output_tokens": tokens, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == tokens, r.text
        return "200"
    if kind == "responses_stream":
        body = {"input": MSG, "max_output_tokens": tokens, "ignore_eos": True, "stream": True}
        async with h.stream("POST", RESP, json=body) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: ")]
        last = events[-1]
        assert last["type"] == "response.incomplete" and last["response"]["usage"]["output_tokens"] == tokens, last
        return "200"
    if kind == "responses_disconnect":
        body = {"input": MSG, "max_output_tokens": 60, "ignore_eos": True, "stream": True}
        async with h.stream("POST", RESP, json=body) as r:
            assert r.status_code == 200
            got, leave_at = 0, rng.randint(1, 8)
            async for ln in r.aiter_lines():
                got += ln.startswith("data: ")
                if got >= leave_at:
                    break  # leaving the block drops the connection mid-stream
        return "disconnected"
    r = await h.post(RESP, json=rng.choice(RESPONSES_REFUSED))
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    return "400"


async def one(kind: str, h: httpx.AsyncClient, adm: httpx.AsyncClient, rng: random.Random) -> str:
    """Run one request of `kind`; returns an outcome label (anything unexpected raises)."""
    if kind.startswith("responses"):
        return await one_responses(kind, h, rng)
    tokens = rng.randint(1, 6)
    if kind == "chat":
        r = await h.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": tokens, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens, r.text
        return "200"
    if kind in ("chat_stream", "chat_n3_stream"):
        n = 3 if kind == "chat_n3_stream" else 1
        body = {"messages": MSG, "max_tokens": tokens, "ignore_eos": True, "stream": True, "n": n,
                "stream_options": {"include_usage": True}}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == n * tokens, events
        return "200"
    if kind == "completion_n2":
        r = await h.post("/v1/completions", json={"prompt": [1, 2, 3, rng.randint(4, 9000)], "max_tokens": tokens,
                                                  "n": 2, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        return "200"
    if kind == "stop_strings":
        stops = ["e", " the", "\n"] + ["".join(rng.choices("abcdefgh", k=rng.randint(1, 40))) for _ in range(5)]
        r = await h.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "stop": stops})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"]
    if kind == "disconnect_stream":
        body = {"messages": MSG, "max_tokens": 60, "ignore_eos": True, "stream": True}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            async for ln in r.aiter_lines():
                got += ln.startswith("data: ")
                if got >= 2:
                    break  # leaving the block drops the connection mid-stream
        return "disconnected"
    if kind == "disconnect_collect":
        try:
            await h.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 200, "ignore_eos": True},
                         timeout=httpx.Timeout(30.0, read=0.05))
            return "finished first"
        except httpx.ReadTimeout:
            return "disconnected"
    if kind == "admin_abort":
        body = {"text": "Count.", "stream": True, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        async with h.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            async for ln in lines:
                if ln.startswith("data: {"):
                    rid = json.loads(ln[6:])["meta_info"]["id"]
                    break
            a = await adm.post("/abort_request", json={"rid": rid})
            assert a.status_code in (200, 404), a.text  # 404: it finished first
            rest = [ln[6:] async for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        return "aborted" if a.status_code == 200 else "finished first"
    if kind == "refused":
        body = rng.choice([{"messages": MSG, "temperature": 9}, {"messages": []}, {"messages": MSG, "n": 99},
                           {"messages": MSG, "stop": "x" * 2000}, {"messages": MSG, "max_tokens": 10**6}])
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        return "400"
    r = await h.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": tokens}})
    assert r.status_code == 200, r.text
    return "200"


async def run(d: Any, count: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    kinds = rng.choices(KINDS, WEIGHTS, k=count)
    outcomes: Counter[str] = Counter()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for k in kinds:
        queue.put_nowait(k)
    # idle connections expire before the daemon closes them (CLIENT_LIMITS: the admin client once met one)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY,
                          keepalive_expiry=CLIENT_LIMITS.keepalive_expiry)
    async with httpx.AsyncClient(base_url=d.base_url, timeout=60.0, limits=limits) as h, httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=d.uds, limits=CLIENT_LIMITS), base_url="http://localhost",
            timeout=60.0) as adm:

        async def worker(i: int) -> None:
            wrng = random.Random(seed * 1000 + i)
            while not queue.empty():
                kind = queue.get_nowait()
                outcomes[f"{kind}:{await one(kind, h, adm, wrng)}"] += 1

        await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    return outcomes


def snapshot(d: Any) -> dict[str, Any]:
    idle = wait_idle(d)
    r = admin(d, "POST", "/admin/flush-cache")  # the prefix cache is a cache: what is left is held
    assert r.status_code == 200, r.text
    # the scheduler's next stats, and its idle heap trim (IDLE_TRIM_AFTER): RSS at rest, not mid-burst
    time.sleep(IDLE_TRIM_AFTER + 2.0)
    s = status(d)
    kv = s["kv_cache"]
    return {"held": idle, "kv_used_ratio": kv["usage_ratio"], "kv_total": kv["total_tokens"],
            "kv_free": kv["free_tokens"], "kv_cached": kv["cached_tokens"], "rss_mib": rss_mib(d)}


def test_soak(tiny_model: Path) -> None:
    d = start_daemon(tiny_model, "--model.context_length", "512")
    try:
        pids = d.workers()
        asyncio.run(run(d, WARMUP, seed=1))
        before = snapshot(d)
        t = time.monotonic()
        outcomes = asyncio.run(run(d, REQUESTS, seed=2))
        took = time.monotonic() - t
        after = snapshot(d)
        print(f"soak: {sum(outcomes.values())} requests in {took:.1f} s ({sum(outcomes.values()) / took:.1f}/s), "
              f"after a warm-up of {WARMUP}")
        print(f"soak: outcomes {dict(sorted(outcomes.items()))}")
        print(f"soak: before {json.dumps(before)}")
        print(f"soak: after  {json.dumps(after)}")
        assert sum(outcomes.values()) == REQUESTS
        assert outcomes["admin_abort:aborted"] > 0 and outcomes["disconnect_stream:disconnected"] > 0
        assert outcomes["responses_disconnect:disconnected"] > 0 and outcomes["responses_stream:200"] > 0
        assert d.workers() == pids, "a worker was restarted during the soak"
        assert not any(after["held"].values())
        assert after["kv_used_ratio"] == before["kv_used_ratio"] == 0, (before, after)
        assert after["kv_free"] == before["kv_free"] == after["kv_total"], (before, after)
        for name, mib in after["rss_mib"].items():
            start = before["rss_mib"][name]
            assert mib <= start * 1.05, f"{name}: RSS {start:.1f} -> {mib:.1f} MiB"
        assert d.health()[0] == 200
    finally:
        stop_and_check(d)
