"""A hybrid model (Qwen3.5) through the daemon: /admin/status and /metrics account for the recurrent
states beside the KV cache (slots, snapshots, bytes a slot), and the slots return when requests end."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from mllmd.testing import checkpoints as ck
from tests.daemon.conftest import DaemonProc, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    model = ck.build_tiny_checkpoint(tmp_path_factory.mktemp("q35") / "tiny-qwen3_5", "Qwen3.5-0.8B",
                                     num_hidden_layers=4, head_dim=32, seed=5)
    d = start_daemon(model, "--cache.state_slots", "6", "--cache.state_snapshot_interval", "64",
                     "--server.max_queued_requests", "4", ready_timeout=180)
    try:
        yield d
    finally:
        stop_and_check(d)


def status(d: DaemonProc) -> dict[str, Any]:
    with d.uds_http() as c:
        return c.get("/admin/status").json()


def wait_for(d: DaemonProc, check: Any, timeout: float = 30.0) -> dict[str, Any]:
    """Poll /admin/status until `check(status)` (the scheduler reports every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        s = status(d)
        if s.get("state_cache") and check(s["state_cache"]):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"state_cache never satisfied the check: {s.get('state_cache')}")
        time.sleep(0.1)


def test_status_and_metrics_account_for_states(daemon: DaemonProc) -> None:
    s = wait_for(daemon, lambda st: st["total_slots"] == 6)
    first = s["state_cache"]
    assert first["free_slots"] == 6 and first["request_slots"] == 0 and first["bytes_per_slot"] > 0
    assert s["model"]["max_running_requests"] == 6  # 64 configured; each running request holds a state slot
    client = daemon.openai()
    long_prompt = " ".join(f"w{i}" for i in range(120))  # > one snapshot interval of tokens
    for _ in range(2):
        r = client.completions.create(model="tiny-qwen3_5", prompt=long_prompt, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens_details.cached_tokens >= 64, "the second request started from a snapshot"
    after = wait_for(daemon, lambda st: st["snapshot_slots"] >= 1 and st["request_slots"] == 0)["state_cache"]
    assert after["free_slots"] + after["snapshot_slots"] == 6
    with daemon.http() as c:
        text = c.get("/metrics").text
    assert 'mllmd_state_cache_usage_ratio{model_name="tiny-qwen3_5"} 0.0' in text
    assert 'mllmd_state_cache_snapshots{model_name="tiny-qwen3_5"}' in text


def test_what_the_server_holds_counts_the_state_slots(daemon: DaemonProc) -> None:
    """Only as many requests as there are state slots run at once: the queue bound adds those (6), not
    scheduler.max_running_requests (64), so that more than server.max_queued_requests waiting is a 503
    and a request that could never be held is a 400 naming the state slots."""
    import httpx

    wait_for(daemon, lambda st: st["total_slots"] == 6)
    with httpx.Client(base_url=daemon.base_url, timeout=120) as h:
        body = {"model": "tiny-qwen3_5", "prompt": "hi", "max_tokens": 2}
        r = h.post("/v1/completions", json={**body, "n": 11})
        assert r.status_code == 400 and "cache.state_slots" in r.json()["error"]["message"], r.text
        r = h.post("/v1/completions", json={**body, "n": 10})
        assert r.status_code == 200 and len(r.json()["choices"]) == 10, r.text


def test_mllmctl_status_prints_the_state_slots(daemon: DaemonProc) -> None:
    from mllmd.ctl import render_status

    s = wait_for(daemon, lambda st: st["total_slots"] == 6 and st["request_slots"] == 0)
    line = [x for x in render_status(s).splitlines() if x.startswith("states:")]
    st = s["state_cache"]
    kib = st["bytes_per_slot"] / 1024
    assert st["free_slots"] + st["snapshot_slots"] == 6 and kib > 1, st
    assert line == [f"states:   0 held by requests, {st['snapshot_slots']} snapshots, {st['free_slots']} free of 6 "
                    f"slots ({kib:.1f} KiB each)"], line

