"""Server features for LAN deployments, against the real daemon on the tiny CPU model (issue 34, item 3).

One daemon serves the module with: two API keys in a key file, CORS for one origin, JSON logs, two
model aliases, an output-token cap, and a short SSE keep-alive interval. Checks: invalid Unicode
anywhere in the JSON is a 400 in OpenAI's shape; X-Request-Id accepted (sanitised) or generated,
returned on successes, errors and SSE, and on the request's log lines; JSON log lines that parse; one
access-log line per request; both keys accepted, others refused; CORS preflight and headers; aliases;
the max_tokens cap; keep-alive comments while the scheduler holds a stream's first token.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon.conftest import short_tmpdir, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(180)

KEYS = ("sk-first-7f3a", "sk-second-91bc")
ORIGIN = "http://webui.lan:8080"
MODEL, ALIAS = "tiny-qwen3", "gpt-4o-mini"
CAP = 5
MSG = [{"role": "user", "content": "Tell me a story."}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def d(tiny_model: Path) -> Iterator[Any]:
    key_file = short_tmpdir() / "keys"
    key_file.write_text(f"# LAN clients\n{KEYS[0]}\n\n   # retired: sk-old\n  {KEYS[1]}  \n")
    proc = start_daemon(
        tiny_model, "--server.api_key_file", str(key_file), "--server.cors_allow_origins", f"[{ORIGIN}]",
        "--logging.format", "json", "--model.served_model_name", f"[{MODEL}, {ALIAS}]",
        "--server.max_tokens_cap", str(CAP), "--server.sse_keepalive_interval", "0.2",
    )
    proc.api_key = KEYS[0]
    yield proc
    stop_and_check(proc)


@pytest.fixture(scope="module")
def h(d: Any) -> Iterator[httpx.Client]:
    with d.http(timeout=60.0) as client:
        yield client


def log_records(d: Any) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (main and workers), parsed."""
    out = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def wait_for_records(d: Any, match: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in log_records(d) if match(r)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ---- 11: invalid Unicode ---------------------------------------------------------------------
SURROGATE_BODIES = {
    "content": '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "key": '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}',
    "nested-tool": ('{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
                    '"function", "function": {"name": "f", "parameters": {"type": "object", "properties": '
                    '{"x": {"description": "\\udbff"}}}}}]}'),
    "model": '{"model": "\\ud83d", "messages": [{"role": "user", "content": "hi"}]}',
    "reversed-pair": '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\\ude00\\ud83d"}]}',
}


@pytest.mark.parametrize("name", sorted(SURROGATE_BODIES))
def test_lone_surrogate_anywhere_is_400(h: httpx.Client, name: str) -> None:
    r = h.post(CHAT, content=SURROGATE_BODIES[name].encode(), headers={"Content-Type": "application/json"})
    assert r.headers["content-type"].startswith("application/json")
    assert_openai_error(r, 400)
    r = h.post("/tokenize", content=SURROGATE_BODIES[name].encode())
    assert_openai_error(r, 400)


# ---- 2: several API keys ---------------------------------------------------------------------
def test_every_key_in_the_file_is_accepted(d: Any) -> None:
    for key in KEYS:
        r = httpx.get(d.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text
    for bad in ("sk-old", KEYS[0] + "x", KEYS[0][:-1], "#", KEYS[1].upper()):
        r = httpx.get(d.base_url + "/v1/models", headers={"Authorization": f"Bearer {bad}"}, timeout=10)
        assert_openai_error(r, 401)
    text = d.log_path.read_text(errors="replace")
    assert not any(k in text for k in KEYS), "an API key reached the log"


# ---- 3-5: request id, JSON logs, access log --------------------------------------------------
def test_request_id_is_echoed_and_on_the_log_lines(d: Any, h: httpx.Client) -> None:
    rid = "client-req-0001"
    r = h.post(CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 2}, headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    access = wait_for_records(d, lambda x: x["logger"] == "mllmd.access" and x["request_id"] == rid)
    assert len(access) == 1, access
    a = access[0]
    assert (a["method"], a["route"], a["status"]) == ("POST", CHAT, 200)
    assert a["completion_tokens"] == 2 and a["prompt_tokens"] > 0 and a["latency_ms"] >= 0
    assert a["level"] == "INFO"
    assert "story" not in json.dumps(a) and KEYS[0] not in json.dumps(a)  # no bodies, no keys
    # the request's other log lines in the main process carry it too (mllmd.requests logs at DEBUG: the
    # access line is the one at INFO); nothing else claims it
    assert all(x["request_id"] == rid for x in log_records(d) if rid in json.dumps(x))


def test_request_id_on_errors_and_streams(d: Any, h: httpx.Client) -> None:
    r = h.post(CHAT, json={"model": "no-such-model", "messages": MSG}, headers={"X-Request-Id": "err-42"})
    assert_openai_error(r, 404)
    assert r.headers["x-request-id"] == "err-42"
    with h.stream("POST", CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 2, "stream": True},
                  headers={"X-Request-Id": "sse-7"}) as s:
        assert s.status_code == 200 and s.headers["x-request-id"] == "sse-7"
        body = "".join(s.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    assert wait_for_records(d, lambda x: x["logger"] == "mllmd.access" and x["request_id"] == "sse-7")


@pytest.mark.parametrize("sent", ["has space", "x" * 129, "caf\u00e9", "tab\there", ""])
def test_bad_request_ids_are_replaced(h: httpx.Client, sent: str) -> None:
    r = h.get("/v1/models", headers=[(b"X-Request-Id", sent.encode("utf-8"))])
    got = r.headers["x-request-id"]
    assert got != sent and len(got) == 32 and all(c in "0123456789abcdef" for c in got)


def test_generated_request_ids_differ(h: httpx.Client) -> None:
    ids = {h.get("/v1/models").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


def test_json_log_lines_parse(d: Any, h: httpx.Client) -> None:
    h.get("/v1/models", headers={"X-Request-Id": "json-check"})
    wait_for_records(d, lambda x: x["request_id"] == "json-check")
    lines = d.log_path.read_text(errors="replace").splitlines()
    ours = [line for line in lines if "mllmd" in line]
    assert ours
    for line in ours:  # every line the daemon and its workers log is one JSON object
        rec = json.loads(line)
        assert {"time", "level", "logger", "process", "message", "request_id"} <= rec.keys(), rec
    processes = {json.loads(line)["process"] for line in ours}
    assert {"mllmd", "mllmd-scheduler"} <= processes, processes


# ---- 1: CORS ---------------------------------------------------------------------------------
def test_cors_preflight_and_headers(d: Any) -> None:
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(d.base_url + CHAT, headers=pre, timeout=10)
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(d.base_url + "/v1/models", headers={"Origin": ORIGIN, **d.headers()}, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # an origin that is not listed gets no CORS header at all
    other = "http://evil.example"
    r = httpx.options(d.base_url + CHAT, headers={**pre, "Origin": other}, timeout=10)
    assert r.status_code != 204 and not any(k.startswith("access-control-") for k in r.headers)
    r = httpx.get(d.base_url + "/v1/models", headers={"Origin": other, **d.headers()}, timeout=10)
    assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)


def test_a_web_page_of_another_origin_or_host_is_refused(d: Any) -> None:
    """CSRF: a page's "simple" POST (text/plain, no preflight) from an origin that is not listed was
    served, the generation run though the page cannot read it; DNS rebinding: a page whose name points
    at 127.0.0.1 sends its own name as Host and reads the answers. Both are 403s now, before the key is
    looked at; the listed origin, loopback Hosts and the Unix socket are served."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    plain = {"Content-Type": "text/plain", **d.headers()}
    r = httpx.post(d.base_url + CHAT, content=body, headers={**plain, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
    assert "server.cors_allow_origins" in r.json()["error"]["message"]
    r = httpx.post(d.base_url + CHAT, content=body, headers={**plain, "Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200, r.text
    for host in ("evil.example", f"evil.example:{d.port}", "192.168.1.7", "127.0.0.1.nip.io"):
        r = httpx.get(d.base_url + "/v1/models", headers={**d.headers(), "Host": host}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
    for host in (f"localhost:{d.port}", "127.0.0.1", f"[::1]:{d.port}", "app.localhost"):
        r = httpx.get(d.base_url + "/v1/models", headers={**d.headers(), "Host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)
    with d.uds_http() as unix:
        r = unix.get("http://evil.example/v1/models", headers=d.headers())
        assert r.status_code == 200, r.text


# ---- 8: aliases; 9: the max_tokens cap --------------------------------------------------------
def test_aliases_are_listed_and_served(d: Any) -> None:
    import openai

    client = d.openai()
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    for name in (MODEL, ALIAS):
        r = client.chat.completions.create(model=name, messages=MSG, max_tokens=1)
        assert r.model == name
        c = client.completions.create(model=name, prompt="Hello", max_tokens=1)
        assert c.model == name
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=1)


def test_max_tokens_cap_and_default(d: Any) -> None:
    client = d.openai()
    big = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=50, extra_body={"ignore_eos": True})
    assert big.usage.completion_tokens == CAP and big.choices[0].finish_reason == "length"
    unset = client.chat.completions.create(model=MODEL, messages=MSG, extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == CAP


# ---- 6: SSE keep-alive -----------------------------------------------------------------------
def test_keepalive_comments_while_the_first_token_waits(d: Any, h: httpx.Client) -> None:
    """The scheduler is stopped (SIGSTOP) so that the first token cannot come: the stream must start
    and carry comment lines until it is resumed, then end normally."""
    sched = d.worker_pid("scheduler")
    os.kill(sched, signal.SIGSTOP)
    beats = 0
    try:
        with h.stream("POST", CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 2, "stream": True}) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            for line in lines:
                if line == ": keep-alive":
                    beats += 1
                    if beats == 3:
                        os.kill(sched, signal.SIGCONT)
                elif line.startswith("data:"):
                    break
            rest = [line for line in lines if line.startswith("data:")]
    finally:
        os.kill(sched, signal.SIGCONT)
    assert beats >= 3
    assert rest[-1] == "data: [DONE]"


# ---- 7: /tokenize and /detokenize ------------------------------------------------------------
def test_tokenize_round_trip(h: httpx.Client, tokenizer: Any) -> None:
    text = "The capital of France is Paris. 東京もいい。"
    r = h.post("/tokenize", json={"model": ALIAS, "prompt": text})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    back = h.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_matches_the_chat_prompt(h: httpx.Client, tokenizer: Any) -> None:
    for add in (True, False):
        r = h.post("/tokenize", json={"model": MODEL, "messages": MSG, "add_generation_prompt": add})
        assert r.status_code == 200, r.text
        want = tokenizer.apply_chat_template(MSG, add_generation_prompt=add, tokenize=False)
        assert r.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    usage = h.post(CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == h.post("/tokenize", json={"messages": MSG}).json()["count"]


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"model": "nope", "prompt": "x"}),
    ("/tokenize", {"prompt": 5}),
    ("/tokenize", {}),
    ("/tokenize", {"messages": []}),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": "yes"}),
    ("/detokenize", {"tokens": [1, "2"]}),
    ("/detokenize", {"tokens": [-1]}),
    ("/detokenize", {"tokens": [10**9]}),
    ("/detokenize", {"tokens": "hi"}),
    ("/detokenize", [1, 2]),
])
def test_tokenize_bad_input(h: httpx.Client, path: str, body: Any) -> None:
    r = h.post(path, json=body)
    assert 400 <= r.status_code < 500
    assert_openai_error(r, r.status_code)


# ---- 12: metrics present from the start; the phase histograms observed ------------------------
def metric_samples(h: httpx.Client) -> dict[str, float]:
    out = {}
    for line in h.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_every_documented_series_is_there_and_the_phases_are_observed(d: Any, h: httpx.Client) -> None:
    m = metric_samples(h)
    label = f'model_name="{MODEL}"'
    for counter in ("mllmd_preemptions_total", "mllmd_prompt_tokens_total", "mllmd_generation_tokens_total",
                    "mllmd_prefix_cache_queries_total", "mllmd_prefix_cache_hits_total"):
        assert f"{counter}{{{label}}}" in m, counter
    for reason in ("stop", "length"):
        assert f'mllmd_request_success_total{{finished_reason="{reason}",{label}}}' in m or \
            f'mllmd_request_success_total{{{label},finished_reason="{reason}"}}' in m
    for reason in ("aborted", "rejected", "error"):
        assert f'mllmd_request_failure_total{{{label},reason="{reason}"}}' in m, reason
    phases = ("mllmd_request_queue_time_seconds", "mllmd_request_prefill_time_seconds",
              "mllmd_request_decode_time_seconds")
    before = {p: m[f"{p}_count{{{label}}}"] for p in phases}
    h.post(CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 3, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while True:  # the scheduler reports timings with its periodic stats
        m = metric_samples(h)
        if all(m[f"{p}_count{{{label}}}"] > before[p] for p in phases) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in phases:
        assert m[f"{p}_count{{{label}}}"] > before[p], p
        assert m[f"{p}_sum{{{label}}}"] >= 0


def hop_counts(h: httpx.Client) -> dict[str, tuple[float, float]]:
    """mllmd_first_token_hop_seconds: hop -> (count, sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(h.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("mllmd_first_token_hop_seconds_") and sample.labels.get("model_name") == MODEL:
                slot = out.setdefault(sample.labels["hop"], [0.0, 0.0])
                if sample.name.endswith("_count"):
                    slot[0] = sample.value
                elif sample.name.endswith("_sum"):
                    slot[1] = sample.value
    return {hop: (c, t) for hop, (c, t) in out.items()}


def test_first_token_hops_are_observed_per_request(d: Any, h: httpx.Client) -> None:
    """A chat request passes every hop once (each observed when main gets its first output, no waiting
    for stats); a token-ids prompt skips the tokenizer, and the hops' sum stays within the client's time."""
    from mllmd.daemon.metrics import FIRST_TOKEN_HOPS

    before = hop_counts(h)
    assert set(before) == set(FIRST_TOKEN_HOPS)
    t0 = time.perf_counter()
    r = h.post(CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 2, "ignore_eos": True})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200
    after = hop_counts(h)
    for hop in FIRST_TOKEN_HOPS:  # a whole (not streamed) reply has no first event: no to_client
        assert after[hop][0] == before[hop][0] + (hop != "to_client"), hop
    spent = sum(after[hop][1] - before[hop][1] for hop in FIRST_TOKEN_HOPS)
    assert 0 < spent <= elapsed
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": [100, 200, 300], "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and "data: [DONE]" in r.text
    last = hop_counts(h)
    assert last["tokenize"][0] == after["tokenize"][0]
    assert all(last[hop][0] == after[hop][0] + 1 for hop in FIRST_TOKEN_HOPS if hop != "tokenize")


def test_bench_serving_prints_the_hop_breakdown(d: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """bench.serving against mllmd reports the mean of each first-token hop over its timed requests."""
    from mllmd.bench.serving import main as serving_main
    from mllmd.daemon.metrics import FIRST_TOKEN_HOPS

    result = serving_main(["--base-url", d.base_url, "--api-key", d.api_key, "--model", MODEL, "--num-prompts", "4",
                           "--token-ids-prompt", "--vocab-size", "5000", "--random-input-len", "8",
                           "--random-output-len", "2", "--random-range-ratio", "1", "--max-concurrency", "2",
                           "--warmup-requests", "1"])
    hops = result["first_token_hops_ms"]
    assert list(hops) == [h for h in FIRST_TOKEN_HOPS if h != "tokenize"]  # token prompts skip the tokenizer
    assert all(ms >= 0 for ms in hops.values())
    assert "First-token hops, mean (ms)" in capsys.readouterr().out


def test_bench_serving_reports_prompts_served_from_the_prefix_cache(d: Any) -> None:
    """A run that repeats an earlier run's prompts (the same seed) finds them in the prefix cache and
    says so: its figures are not a cold run's."""
    from mllmd.bench.serving import main as serving_main

    def run(seed: int) -> float:
        result = serving_main(["--base-url", d.base_url, "--api-key", d.api_key, "--model", MODEL, "--num-prompts", "4",
                               "--token-ids-prompt", "--vocab-size", "5000", "--random-input-len", "96",
                               "--random-output-len", "2", "--random-range-ratio", "1", "--max-concurrency", "2",
                               "--warmup-requests", "0", "--seed", str(seed)])  # fmt: skip
        return result["prefix_cache_hit_rate"]

    cold = run(7001)
    again = run(7001)
    assert cold < 0.5 < again


# ---- 10: while the boot model loads ------------------------------------------------------------
def test_requests_while_the_boot_model_loads_get_503_loading(daemon_factory: Any) -> None:
    """The scheduler worker is held (SIGSTOP) as soon as it exists, so that the load cannot finish
    while we look; it is let go at the end and the daemon becomes ready."""
    d = daemon_factory(wait=False)
    sched = d.worker_pid("scheduler", timeout=60)
    os.kill(sched, signal.SIGSTOP)
    try:
        health = d.wait_health(503, timeout=60)
        if health.get("state") != "loading":
            pytest.skip(f"the daemon was {health.get('state')} before the scheduler could be held")
        r = httpx.post(d.base_url + CHAT, json={"model": MODEL, "messages": MSG}, timeout=10)
        err = assert_openai_error(r, 503)
        assert "loading" in err["message"] and r.headers.get("retry-after")
        r = httpx.post(d.base_url + CHAT, json={"messages": MSG}, timeout=10)
        assert "loading" in assert_openai_error(r, 503)["message"]
    finally:
        os.kill(sched, signal.SIGCONT)
    d.wait_health(200)


def test_output_token_default_and_cap() -> None:
    """server.default_max_tokens fills an unset max_tokens; server.max_tokens_cap lowers any."""
    from types import SimpleNamespace

    from mllmd.daemon.config import load_config
    from mllmd.daemon.http_app import Api
    from mllmd.messages import OutputBudget

    def budget(requested: int | None, default: int | None, **cfg: Any) -> tuple[int | None, int | None]:
        api = Api(SimpleNamespace(config=load_config("/dev/null", {f"server.{k}": v for k, v in cfg.items()})))  # type: ignore[arg-type]
        b = api._budget(OutputBudget(requested, default), None)
        return b.requested, b.default

    assert budget(None, None) == (None, 4096)  # the documented default
    assert budget(None, None, default_max_tokens=None) == (None, None)  # the rest of the context
    assert budget(100, None) == (100, 4096)  # a client's max_tokens is kept
    assert budget(None, 16) == (None, 16)  # /v1/completions keeps OpenAI's 16
    assert budget(100, None, max_tokens_cap=50) == (50, 50)
    assert budget(None, None, default_max_tokens=None, max_tokens_cap=50) == (None, 50)


def test_sighup_before_ready_does_not_announce_ready() -> None:
    """A SIGHUP while the model still loads (logrotate, kill -HUP) sent READY=1 after its RELOADING=1, so
    systemd started the units ordered after mllmd before it could serve. READY=1 follows a reload only
    once the daemon has announced it is ready, and so does RELOADING=1 (systemd acts on it only for a
    running service; with MONOTONIC_USEC= it matches the reload to its SIGHUP)."""
    from types import SimpleNamespace

    from mllmd.daemon.main import Daemon
    from mllmd.daemon.sd_notify import Notifier

    for announced, expected in ((False, []), (True, ["RELOADING=1", "READY=1"])):
        sent: list[str] = []
        notifier = Notifier()
        notifier.send = sent.append  # type: ignore[method-assign]
        fake = SimpleNamespace(notifier=notifier, reload_config=lambda: None, _announced_ready=announced)
        Daemon._on_sighup(fake)  # type: ignore[arg-type]
        assert [line.split("\n")[0] for line in sent] == expected
        if announced:
            assert sent[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
