"""What the hardening tests share: the daemon's status and processes, RSS, bounded waits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from tests.daemon.conftest import DaemonProc


def status(d: DaemonProc, timeout: float = 10.0) -> dict[str, Any]:
    """/admin/status over the Unix socket (the admin channel: no key needed)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=d.uds), base_url="http://localhost", timeout=timeout) as c:
        r = c.get("/admin/status")
        assert r.status_code == 200, r.text
        return r.json()


def admin(d: DaemonProc, method: str, path: str, body: Any = None, timeout: float = 30.0) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(uds=d.uds), base_url="http://localhost", timeout=timeout) as c:
        return c.request(method, path, json=body)


def tracked(d: DaemonProc) -> dict[str, Any]:
    """What every process keeps per request: main's requests, groups and metric timelines, the running
    and waiting counts, and each worker's per-request state (from its heartbeat)."""
    s = status(d)
    req = s["requests"]
    return {**req["tracked"], "in_flight": req["in_flight"], "running": req["running"], "waiting": req["waiting"],
            **{f"worker_{w['name']}": w["requests"] or 0 for w in s["workers"]}}


def wait_idle(d: DaemonProc, timeout: float = 60.0) -> dict[str, Any]:
    """Wait (bounded) until nothing is held for any request anywhere; returns the last counts."""
    deadline = time.monotonic() + timeout
    while True:
        t = tracked(d)
        if not any(t.values()):
            return t
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still held after {timeout} s: {t}\n{d.log_tail()}")
        time.sleep(0.2)


def proc_status(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mib(d: DaemonProc) -> dict[str, float]:
    """RSS of the main process and of each worker, in MiB."""
    pids = {"main": d.proc.pid, **d.workers()}
    return {name: proc_status(pid, "VmRSS") / 1024 for name, pid in pids.items()}


def post_raw(client: httpx.Client, path: str, body: bytes | str) -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return client.post(path, content=data, headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of `r`, which must have `status`."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def nested(depth: int, leaf: Any = 1) -> Any:
    """{"a": {"a": ... leaf}} nested `depth` levels (built iteratively; json.dumps of it is safe)."""
    out: Any = leaf
    for _ in range(depth):
        out = {"a": out}
    return out


def deep_json(depth: int) -> str:
    """The JSON text of `nested(depth)` without recursion (json.dumps would hit the recursion limit)."""
    return '{"a": ' * depth + "1" + "}" * depth


def log_lines(d: DaemonProc) -> list[str]:
    return d.log_path.read_text(errors="replace").splitlines()


def sse_events(raw: str) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e)
            for e in (ln[6:] for ln in raw.split("\n") if ln.startswith("data: "))]
