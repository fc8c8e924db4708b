"""systemd integration: the test owns the NOTIFY_SOCKET datagram socket and reads what mllmd sends."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import READY_TIMEOUT, NotifyListener, short_tmpdir, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(180)


def test_ready_status_watchdog_stopping(tiny_model: Path) -> None:
    tmp = short_tmpdir()
    listener = NotifyListener(tmp / "notify.sock")
    d: Any = None
    try:
        d = start_daemon(tiny_model, env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "400000"},
                         wait=False)
        t_ready = listener.wait_for("READY=1", READY_TIMEOUT)
        # READY=1 only once serving: /health answers 200 right away
        code, _ = d.health()
        assert code == 200
        lines = listener.lines()
        status = [m for m in lines if m.startswith("STATUS=")]
        assert any("loading" in s for s in status), status
        assert lines.index("READY=1") > min(i for i, m in enumerate(lines) if "loading" in m)
        listener.drain(1.0)
        assert any(m.startswith("STATUS=ready") for m in listener.lines()), listener.lines()
        # watchdog: every WATCHDOG_USEC/2 = 0.2 s while the main loop is alive
        start = time.monotonic()
        listener.drain(1.5)
        pings = [t for t, m in listener.messages if m == "WATCHDOG=1" and t >= start]
        assert len(pings) >= 3, listener.lines()
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert max(gaps) < 0.4 * 1.5, gaps  # well inside WATCHDOG_USEC
        assert t_ready > 0
        # SIGTERM -> STOPPING=1, then a clean exit
        d.proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING=1", 10)
        assert d.proc.wait(20) == 0, d.log_tail()
        listener.drain(0.2)
        lines = listener.lines()
        assert lines.index("STOPPING=1") > lines.index("READY=1")
        assert any(m.startswith("STATUS=draining") for m in lines), lines
    finally:
        listener.close()
        if d is not None:
            stop_and_check(d)


def test_no_watchdog_without_watchdog_usec(tiny_model: Path) -> None:
    """Without WATCHDOG_USEC nothing pings; READY=1 is still sent exactly once."""
    tmp = short_tmpdir()
    listener = NotifyListener(tmp / "notify.sock")
    d: Any = None
    try:
        d = start_daemon(tiny_model, env={"NOTIFY_SOCKET": str(listener.path)}, wait=False)
        listener.wait_for("READY=1", READY_TIMEOUT)
        listener.drain(0.8)
        assert "WATCHDOG=1" not in listener.lines()
        assert listener.lines().count("READY=1") == 1
    finally:
        listener.close()
        if d is not None:
            stop_and_check(d)


def test_sighup_sends_reloading_with_monotonic_usec_then_ready(tiny_model: Path) -> None:
    """SIGHUP: RELOADING=1 with MONOTONIC_USEC= in the same datagram (systemd 253+ needs it to match
    the reload to its signal), then READY=1."""
    tmp = short_tmpdir()
    listener = NotifyListener(tmp / "notify.sock")
    d: Any = None
    try:
        d = start_daemon(tiny_model, env={"NOTIFY_SOCKET": str(listener.path)}, wait=False)
        listener.wait_for("READY=1", READY_TIMEOUT)
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        d.proc.send_signal(signal.SIGHUP)
        listener.wait_for("RELOADING=1", 30)
        deadline = time.monotonic() + 30
        while listener.lines().count("READY=1") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        lines = listener.lines()
        i = lines.index("RELOADING=1")
        assert lines[i + 1].startswith("MONOTONIC_USEC="), lines
        assert int(lines[i + 1].split("=", 1)[1]) >= before
        assert "READY=1" in lines[i + 2:], lines
    finally:
        listener.close()
        if d is not None:
            stop_and_check(d)


def test_sigterm_drains_in_flight_requests(tiny_model: Path) -> None:
    """SIGTERM: new requests are refused (503); a short in-flight request finishes; long ones are cut
    off after server.shutdown_timeout with a 503 error (HTTP, or an SSE error event once streaming);
    the exit status is 0."""
    import threading

    import httpx

    grace = 6.0
    d = start_daemon(tiny_model, "--server.shutdown_timeout", str(grace))
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        url = d.base_url + "/v1/chat/completions"
        results: dict[str, Any] = {}

        def short() -> None:
            r = httpx.post(url, json={**body, "max_tokens": 100}, timeout=60)
            results["short"] = (r.status_code, r.text)

        def long() -> None:
            r = httpx.post(url, json={**body, "max_tokens": 30000}, timeout=60)
            results["long"] = (time.monotonic(), r.status_code, r.text)

        def long_stream() -> None:
            lines = []
            with httpx.stream("POST", url, timeout=60, json={**body, "max_tokens": 30000, "stream": True}) as r:
                lines += list(r.iter_lines())
            results["long_stream"] = (time.monotonic(), lines)

        threads = [threading.Thread(target=f) for f in (long, long_stream, short)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(url, json={**body, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text  # draining: nothing new is accepted
        assert json.loads(r.text)["error"]["message"]
        for t in threads:
            t.join(60)
        assert d.proc.wait(20) == 0, d.log_tail()
        code, text = results["short"]
        assert code == 200 and json.loads(text)["usage"]["completion_tokens"] == 100, text
        ended, code, text = results["long"]
        assert code == 503 and "shutting down" in json.loads(text)["error"]["message"], (code, text)
        assert grace - 0.5 < ended - t0 < grace + 5
        ended, lines = results["long_stream"]
        events = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert "[DONE]" not in events, "a 30000-token request cannot have finished"
        assert "shutting down" in json.loads(events[-1])["error"]["message"], events[-2:]
        assert grace - 0.5 < ended - t0 < grace + 5
    finally:
        stop_and_check(d)
