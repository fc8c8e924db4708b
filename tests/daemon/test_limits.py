"""Back-pressure and disconnects: a bounded waiting queue (503 + Retry-After past it), and requests
whose clients go away are aborted at once (their slot and KV are free for the next request)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from .conftest import start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "Write a long poem."}]


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def run_request(base_url: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """Send one request; returns status, headers, and for 200 the completion token count."""
    with httpx.Client(base_url=base_url, timeout=timeout) as h:
        if not body.get("stream"):
            r = h.post("/v1/chat/completions", json=body)
            out = {"status": r.status_code, "headers": dict(r.headers), "json": r.json()}
            if r.status_code == 200:
                out["tokens"] = r.json()["usage"]["completion_tokens"]
            return out
        body = {**body, "stream_options": {"include_usage": True}}
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "headers": dict(r.headers), "json": r.json()}
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        usage = json.loads(events[-2])["usage"]
        return {"status": 200, "headers": dict(r.headers), "tokens": usage["completion_tokens"]}


def concurrently(base_url: str, bodies: list[dict[str, Any]], timeout: float = 120.0) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def worker(i: int) -> None:
        barrier.wait(30)
        try:
            results[i] = run_request(base_url, bodies[i])
        except Exception as e:  # recorded, asserted below
            results[i] = {"status": None, "exception": repr(e)}

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "requests hung"
    return results  # type: ignore[return-value]


# ---- overload --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tiny_model: Any) -> Any:
    d = start_daemon(tiny_model, "--server.max_queued_requests", "2", "--scheduler.max_running_requests", "2")
    yield d
    stop_and_check(d)


def test_overload_rejects_excess_with_503(small: Any) -> None:
    bodies = [chat(150, stream=bool(i % 2)) for i in range(20)]
    results = concurrently(small.base_url, bodies)
    statuses = [r["status"] for r in results]
    assert set(statuses) <= {200, 503}, results
    ok = [r for r in results if r["status"] == 200]
    busy = [r for r in results if r["status"] == 503]
    # at most running + queued = 4 are ever in flight; everything before that is admitted
    assert len(ok) >= 4, statuses
    assert len(busy) >= 8, statuses
    assert all(r["tokens"] == 150 for r in ok)
    for r in busy:
        headers = {k.lower(): v for k, v in r["headers"].items()}
        assert headers.get("retry-after", "").isdigit(), headers
        err = r["json"]["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "capacity" in err["message"]


def test_overload_leaves_nothing_behind(small: Any) -> None:
    """After the storm: healthy, and exactly running + queued concurrent requests are all admitted."""
    code, _ = small.health()
    assert code == 200
    results = concurrently(small.base_url, [chat(20, stream=bool(i % 2)) for i in range(4)])
    assert [r["status"] for r in results] == [200] * 4, results
    assert run_request(small.base_url, chat(3))["tokens"] == 3


def test_queue_bound_is_running_plus_queued(small: Any) -> None:
    """With 2 requests running and 2 waiting, a 5th is refused (n=2 counts twice); the 4 complete."""
    results: list[dict[str, Any]] = []

    def hold(stream: bool) -> None:
        results.append(run_request(small.base_url, chat(400, stream=stream)))

    holders = [threading.Thread(target=hold, args=(bool(i % 2),), daemon=True) for i in range(4)]
    for t in holders:
        t.start()
    time.sleep(1.5)  # all four are in: 2 running, 2 waiting (each takes seconds)
    probe = run_request(small.base_url, chat(1))
    probe_n2 = run_request(small.base_url, {**chat(1), "n": 2})
    for t in holders:
        t.join(90)
    assert not any(t.is_alive() for t in holders)
    assert [r["status"] for r in results] == [200] * 4, results
    assert all(r["tokens"] == 400 for r in results)
    assert probe["status"] == 503, "a fifth request was admitted with 2 running and 2 waiting"
    assert probe_n2["status"] == 503
    assert run_request(small.base_url, chat(1))["status"] == 200


# ---- disconnects -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serial(tiny_model: Any) -> Any:
    """One running request at a time: anything still running blocks the next request entirely."""
    d = start_daemon(tiny_model, "--scheduler.max_running_requests", "1")
    yield d
    stop_and_check(d)


def _full_length_estimate(d: Any) -> float:
    """Seconds a 2000-token request would take (from a timed 150-token one)."""
    t = time.monotonic()
    assert run_request(d.base_url, chat(150))["tokens"] == 150
    return (time.monotonic() - t) * 2000 / 150


def _short_latency(d: Any) -> float:
    t = time.monotonic()
    assert run_request(d.base_url, chat(4))["tokens"] == 4
    return time.monotonic() - t


def test_streaming_disconnect_aborts(serial: Any) -> None:
    full = _full_length_estimate(serial)
    with httpx.Client(base_url=serial.base_url, timeout=30) as h:
        with h.stream("POST", "/v1/chat/completions", json=chat(2000, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 5:
                if next(lines).startswith("data: "):
                    got += 1
        # leaving the block closes the connection mid-stream
    latency = _short_latency(serial)
    assert latency < max(2.0, full / 4), f"next request took {latency:.2f} s (full run ~{full:.1f} s)"
    code, _ = serial.health()
    assert code == 200


def test_non_streaming_disconnect_aborts(serial: Any) -> None:
    full = _full_length_estimate(serial)
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=serial.base_url, timeout=httpx.Timeout(10.0, read=1.0)) as h:
            h.post("/v1/chat/completions", json=chat(2000))
    latency = _short_latency(serial)
    assert latency < max(2.5, full / 4), f"next request took {latency:.2f} s (full run ~{full:.1f} s)"


def test_disconnect_while_waiting_aborts(serial: Any) -> None:
    """A request still in the waiting queue is dropped when its client leaves."""
    full = _full_length_estimate(serial)
    with httpx.Client(base_url=serial.base_url, timeout=30) as h1:
        with h1.stream("POST", "/v1/chat/completions", json=chat(2000, stream=True)) as running:
            lines = running.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            # a second long request waits behind the first; its client gives up
            with pytest.raises(httpx.ReadTimeout):
                with httpx.Client(base_url=serial.base_url, timeout=httpx.Timeout(10.0, read=0.7)) as h2:
                    with h2.stream("POST", "/v1/chat/completions", json=chat(2000, stream=True)) as waiting:
                        for _ in waiting.iter_lines():  # nothing but (at most) the role chunk comes
                            pass
            for _ in range(3):
                next(lines)
    latency = _short_latency(serial)
    assert latency < max(2.5, full / 4), f"next request took {latency:.2f} s (full run ~{full:.1f} s)"


def test_n_beyond_the_whole_queue_is_a_400_not_a_503(small: Any) -> None:
    """n=5 can never fit running (2) + queued (2): retrying cannot help, so it is the client's error."""
    r = httpx.post(small.base_url + "/v1/chat/completions", json={**chat(3), "n": 5}, timeout=30)
    assert r.status_code == 400 and "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == "n" and "n=5" in err["message"] and "max_queued_requests" in err["message"]
    assert run_request(small.base_url, {**chat(3), "n": 4})["status"] == 200


def _aborted_total(d: Any) -> float:
    for line in httpx.get(d.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mllmd_request_failure_total{") and 'reason="aborted"' in line:
            return float(line.rpartition(" ")[2])
    raise AssertionError("mllmd_request_failure_total{reason=aborted} is missing")


def test_a_stream_left_midway_is_counted_aborted_and_logged_cut(serial: Any) -> None:
    """The status line said 200, but the client never got the end: the access log says outcome=cut
    (not a plain 200), and the request counts as aborted in /metrics."""
    before = _aborted_total(serial)
    with httpx.Client(base_url=serial.base_url, timeout=30) as h:
        with h.stream("POST", "/v1/chat/completions", json=chat(2000, stream=True),
                      headers={"X-Request-Id": "left-midway-1"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
    deadline = time.monotonic() + 30
    while (_aborted_total(serial) < before + 1 or "left-midway-1" not in serial.log_path.read_text(errors="replace")) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (aborted := _aborted_total(serial)) >= before + 1
    line = [x for x in serial.log_path.read_text(errors="replace").splitlines() if "left-midway-1" in x and "outcome=" in x]
    assert len(line) == 1 and " 200 outcome=cut " in line[0], line
    # a stream read to its end is "ok", and nothing more counts as aborted
    with httpx.Client(base_url=serial.base_url, timeout=30) as h:
        r = h.post("/v1/chat/completions", json=chat(3, stream=True), headers={"X-Request-Id": "read-to-end-1"})
        assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
    deadline = time.monotonic() + 30
    while "read-to-end-1" not in serial.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    line = [x for x in serial.log_path.read_text(errors="replace").splitlines() if "read-to-end-1" in x and "outcome=" in x]
    assert len(line) == 1 and " 200 outcome=ok " in line[0], line
    assert _aborted_total(serial) == aborted
