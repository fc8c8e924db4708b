"""Fault tests: killed, hung and repeatedly crashing workers.

A worker that dies (kill -9) or hangs (SIGSTOP: no heartbeats) fails the requests in flight at
once, is restarted automatically, and serving resumes; repeated crashes leave the daemon up but
`degraded`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from typing import Any

import httpx
import pytest

from .conftest import NotifyListener, pid_alive, process_state, short_tmpdir, start_daemon

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-qwen3"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a million."}], "max_tokens": 2000,
        "ignore_eos": True, "stream": True}
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}


class StreamWatcher:
    """Reads an SSE response line by line; records content chunks, error events and [DONE]."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.iter_lines()
        self.chunks = 0
        self.error: dict[str, Any] | None = None
        self.done = False
        self.ended = False

    def read_until_chunks(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks < n:
            assert time.monotonic() < deadline, "the stream did not start"
            self._next()
            assert not (self.ended or self.error), f"stream ended early: {self.error}"

    def read_to_end(self) -> None:
        while not (self.ended or self.error or self.done):
            self._next()

    def _next(self) -> None:
        try:
            line = next(self.lines)
        except StopIteration:
            self.ended = True
            return
        if not line.startswith("data: "):
            return
        data = line[6:]
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if "error" in obj:
            self.error = obj["error"]
        else:
            self.chunks += 1


def kill_during_stream(d: Any, worker: str, sig: int, deadline_s: float) -> tuple[int, float, StreamWatcher]:
    """Start a long stream, send `sig` to `worker`, and read on: the stream must end (an SSE error
    event, or the connection closing without [DONE]) within `deadline_s`. Returns (pid, seconds, watcher)."""
    pid = d.worker_pid(worker)
    with httpx.Client(base_url=d.base_url, timeout=httpx.Timeout(30.0, read=deadline_s + 2)) as h:
        with h.stream("POST", "/v1/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            w = StreamWatcher(r)
            w.read_until_chunks(3, timeout=30)
            t0 = time.monotonic()
            os.kill(pid, sig)
            try:
                w.read_to_end()
            except httpx.ReadTimeout:
                pytest.fail(f"no error within {deadline_s + 2} s after {signal.Signals(sig).name} of the {worker} worker")
            elapsed = time.monotonic() - t0
    assert not w.done, "the stream finished normally although its worker was killed"
    assert w.error is not None or w.ended
    if w.error is not None:
        assert set(w.error) >= {"message", "type", "param", "code"}
        assert "restart" in w.error["message"] or "worker" in w.error["message"]
    assert elapsed < deadline_s, f"the client saw the failure after {elapsed:.2f} s"
    return pid, elapsed, w


def assert_serving(d: Any) -> float:
    """A short request succeeds; returns its latency."""
    t = time.monotonic()
    with d.http() as h:
        r = h.post("/v1/chat/completions", json=SHORT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    return time.monotonic() - t


def long_run_seconds(d: Any) -> float:
    """Seconds the 2000-token LONG request takes (extrapolated from a timed 150-token one)."""
    t = time.monotonic()
    with d.http() as h:
        r = h.post("/v1/chat/completions", json={**SHORT, "max_tokens": 150})
        assert r.status_code == 200, r.text
    return (time.monotonic() - t) * LONG["max_tokens"] / 150


def wait_replaced(d: Any, worker: str, old_pid: int, timeout: float = 90.0) -> int:
    """Wait for a new `worker` process, then for /health 200 (in this order: right after a kill,
    /health can still say 200 for a moment, before the supervisor has noticed)."""
    deadline = time.monotonic() + timeout
    while (new := d.workers().get(worker)) in (None, old_pid):
        assert time.monotonic() < deadline, f"the {worker} worker was not replaced\n{d.log_tail()}"
        time.sleep(0.05)
    d.wait_health(200, max(1.0, deadline - time.monotonic()))
    assert d.workers().get(worker) == new
    assert not pid_alive(old_pid)
    return new


@pytest.mark.slow
def test_kill9_workers_during_stream(daemon_factory: Any) -> None:
    # One running request at a time: were the killed stream's request left running in the engine
    # (when the tokenizer or detokenizer dies, the scheduler lives on), the next request would wait.
    d = daemon_factory("--scheduler.max_running_requests", "1")
    full = long_run_seconds(d)
    for worker in ("scheduler", "detokenizer"):
        pid, elapsed, w = kill_during_stream(d, worker, signal.SIGKILL, deadline_s=5.0)
        wait_replaced(d, worker, pid)
        latency = assert_serving(d)
        assert latency < max(3.0, full / 4), f"after the {worker} restart a short request took {latency:.1f} s"
    # a stream already generating never needs the tokenizer again: it goes on to its end while the
    # tokenizer worker is replaced (before, every stream in flight failed with it)
    pid = d.worker_pid("tokenizer")
    with httpx.Client(base_url=d.base_url, timeout=httpx.Timeout(30.0, read=full + 30)) as h:
        with h.stream("POST", "/v1/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            w = StreamWatcher(r)
            w.read_until_chunks(3, timeout=30)
            os.kill(pid, signal.SIGKILL)
            w.read_to_end()
    assert w.done and w.error is None and w.chunks > LONG["max_tokens"] // 2, (w.error, w.chunks)  # a chunk: a token or more
    wait_replaced(d, "tokenizer", pid)
    assert_serving(d)
    # the other workers were not disturbed by the last restart, and all three are alive
    assert set(d.workers()) == {"tokenizer", "scheduler", "detokenizer"}


def test_kill9_scheduler_non_streaming(daemon_factory: Any) -> None:
    """A non-streaming request held by a killed scheduler gets a 503 in the OpenAI shape, at once."""
    d = daemon_factory()
    pid = d.worker_pid("scheduler")
    body = {**LONG, "stream": False}
    import threading

    result: dict[str, Any] = {}

    def post() -> None:
        with d.http(timeout=30) as h:
            t = time.monotonic()
            r = h.post("/v1/chat/completions", json=body)
            result.update(status=r.status_code, body=r.json(), at=time.monotonic(), took=time.monotonic() - t,
                          headers=r.headers)

    th = threading.Thread(target=post)
    th.start()
    time.sleep(1.0)  # let it start decoding
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    th.join(10)
    assert not th.is_alive(), "the request hung after its worker was killed"
    assert result["status"] == 503, result
    assert set(result["body"]["error"]) == {"message", "type", "param", "code"}
    assert "scheduler" in result["body"]["error"]["message"]
    assert result["headers"].get("retry-after", "").isdigit()
    assert result["at"] - t0 < 5.0
    wait_replaced(d, "scheduler", pid)
    assert_serving(d)


def test_sigstop_scheduler_detected_and_replaced(daemon_factory: Any) -> None:
    timeout = 2.0
    d = daemon_factory("--workers.heartbeat_timeout", str(timeout), "--workers.heartbeat_interval", "0.3")
    pid = d.worker_pid("scheduler")
    # the in-flight stream fails within the heartbeat timeout (plus the supervisor's poll and slack)
    kill_during_stream(d, "scheduler", signal.SIGSTOP, deadline_s=timeout + 2.0)
    # declared hung only once its last heartbeat was `timeout` old (the supervisor's reason says how old;
    # on a loaded machine that beat may have come late already, so the time since the SIGSTOP says less)
    silences = [float(m) for m in re.findall(r"scheduler worker sent no heartbeat for ([0-9.]+) s",
                                             d.log_path.read_text(errors="replace"))]
    assert silences and all(s >= timeout for s in silences), (silences, d.log_tail())
    # the stopped process was killed (not left stopped) and replaced
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), f"the hung worker is still there (state {process_state(pid)})"
    new = wait_replaced(d, "scheduler", pid)
    assert process_state(new) in ("R", "S", "D")
    assert_serving(d)
    code, body = d.health()
    assert code == 200 and body["state"] == "ready"


def test_repeated_crashes_degrade(daemon_factory: Any) -> None:
    listener = NotifyListener(short_tmpdir() / "notify.sock")
    try:
        _repeated_crashes_degrade(daemon_factory, listener)
    finally:
        listener.close()


def _repeated_crashes_degrade(daemon_factory: Any, listener: NotifyListener) -> None:
    d = daemon_factory("--workers.max_restarts", "1", env={"NOTIFY_SOCKET": str(listener.path)})
    first = d.worker_pid("scheduler")
    os.kill(first, signal.SIGKILL)
    second = wait_replaced(d, "scheduler", first)
    assert_serving(d)
    os.kill(second, signal.SIGKILL)  # the second crash within the window: give up (no restart made)
    deadline = time.monotonic() + 10
    while True:  # 503 "loading" first (the worker is gone), then "degraded" once the supervisor sees it
        code, body = d.health()
        if code == 503 and body.get("state") == "degraded" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert code == 503 and body["state"] == "degraded", body
    assert "degraded" in body["reason"] and "scheduler" in body["reason"], body
    # it stays up and degraded: no restart, HTTP answers, requests get a 503 in the OpenAI shape
    time.sleep(2.0)
    code, body = d.health()
    assert code == 503 and "degraded" in body["reason"]
    assert "scheduler" not in d.workers()
    assert d.proc.poll() is None
    # one restart was made, and counted once: the give-up is neither a restart nor logged as one
    with d.uds_http() as admin:
        [sched] = [w for w in admin.get("/admin/status").json()["workers"] if w["name"] == "scheduler"]
        metrics = admin.get("/metrics").text
    assert sched["restarts"] == 1 and "status -9" in (sched["last_error"] or ""), sched
    assert 'mllmd_worker_restarts_total{worker="scheduler"} 1.0' in metrics
    log = d.log_path.read_text(errors="replace")
    assert log.count("scheduler worker exited with status -9; restarting") == 1, d.log_tail()
    with d.http() as h:
        assert h.get("/v1/models").status_code == 200
        r = h.post("/v1/chat/completions", json=SHORT)
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "degraded" in err["message"]
        assert "retry-after" in r.headers
    # systemd hears about it too (READY=1 was sent once, at start)
    listener.drain(0.5)
    lines = listener.lines()
    assert lines.count("READY=1") == 1, lines
    assert any(m.startswith("STATUS=degraded") for m in lines), lines


def test_workers_exit_when_main_is_killed(tiny_model: Any) -> None:
    """kill -9 of the main process (no SIGTERM, no supervisor) leaves no orphaned workers behind."""
    d = start_daemon(tiny_model, "--workers.heartbeat_interval", "0.3")
    try:
        workers = d.workers()
        assert set(workers) == {"tokenizer", "scheduler", "detokenizer"}
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in workers.values()), {k: process_state(p) for k, p in workers.items()}
    finally:
        d.kill_group()
        shutil.rmtree(d.workdir, ignore_errors=True)
