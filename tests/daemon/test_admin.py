"""Control plane against a live daemon: admin routes, mllmctl, hot swap, restart memory, /metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.conftest import DaemonProc, daemon_env, start_daemon, stop_and_check

PROMPT = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny models with different weights, a corrupt one and an unsupported one."""
    from mllmd.testing.checkpoints import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("models")
    build_tiny_checkpoint(root / "alpha", "Qwen3-0.6B", seed=11)
    build_tiny_checkpoint(root / "beta", "Qwen3-0.6B", seed=22)
    corrupt = root / "corrupt"
    shutil.copytree(root / "alpha", corrupt)
    weights = next(corrupt.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    odd = root / "odd-arch"
    shutil.copytree(root / "alpha", odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    bad_shapes = root / "bad-shapes"  # passes the header checks; fails in the worker
    shutil.copytree(root / "alpha", bad_shapes)
    cfg = json.loads((bad_shapes / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (bad_shapes / "config.json").write_text(json.dumps(cfg))
    return root


def ctl(d: DaemonProc, *args: str, user: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mllmd.ctl", "--socket", d.uds, *args]
    if user is not None:  # an unprivileged uid; the system python (ours may live under /root); stdlib only
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "/usr/bin/python3", *cmd[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=daemon_env())


def greedy(d: DaemonProc, max_tokens: int = 12) -> tuple[str, str]:
    r = d.http().post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                                    "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["model"], body["choices"][0]["message"]["content"]


def wait_model(d: DaemonProc, name: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = json.loads(ctl(d, "status", "--json").stdout)
        if s["state"] == "ready" and (s.get("model") or {}).get("served_name") == name and not s["load"]["in_progress"]:
            return s
        time.sleep(0.3)
    raise AssertionError(f"{name} not active after {timeout} s:\n{d.log_tail()}")


@pytest.fixture
def daemon_ab(models_dir: Path) -> Any:
    d = start_daemon(models_dir / "alpha")
    yield d
    stop_and_check(d)


def test_status_models_flush_reload_drain(daemon_ab: DaemonProc) -> None:
    d = daemon_ab
    out = ctl(d, "status")
    assert out.returncode == 0 and "state:    ready" in out.stdout and "alpha" in out.stdout
    s = json.loads(ctl(d, "status", "--json").stdout)
    assert s["model"]["architecture"] == "Qwen3ForCausalLM" and s["version"]
    assert {w["name"] for w in s["workers"]} == {"tokenizer", "scheduler", "detokenizer"}
    assert all(w["pid"] and w["restarts"] == 0 for w in s["workers"])
    assert s["config"]["server"]["port"] == d.port
    models = json.loads(ctl(d, "models", "--json").stdout)["models"]
    by_name = {m["name"]: m for m in models}
    assert by_name["alpha"]["architecture"] == "Qwen3ForCausalLM" and by_name["alpha"]["parameters"] > 0
    assert by_name["alpha"]["size_bytes"] > 0 and by_name["alpha"]["error"] is None
    assert "corrupt" in by_name["corrupt"]["error"] or "truncated" in by_name["corrupt"]["error"]
    greedy(d)  # leaves a cached prefix
    out = ctl(d, "flush-cache")
    assert out.returncode == 0 and "tokens freed" in out.stdout
    out = ctl(d, "reload")
    assert out.returncode == 0 and "applied" in out.stdout
    out = ctl(d, "drain")
    assert out.returncode == 0
    assert d.health()[1]["state"] == "draining"
    r = d.http().post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["message"]
    assert ctl(d, "load-model", "alpha", "--wait").returncode == 0  # a load ends the drain
    assert d.health()[0] == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [(b"{not json", "valid JSON"), (b'{"model": NaN}', "valid JSON"), ('{"model": "alpha"}'.encode("utf-16"), "UTF-8"),
     (b"[1, 2]", "JSON object")],
)
def test_admin_bodies_follow_the_api_json_rules(daemon_ab: DaemonProc, body: bytes, needle: str) -> None:
    """Admin bodies are decoded as the OpenAI routes' are: UTF-8 JSON, no NaN; errors are 400s that say so."""
    r = daemon_ab.uds_http().post("/admin/models/load", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    ("ref", "needle"),
    [("/etc", "outside the allowed models dirs"), ("corrupt", "truncated"), ("odd-arch", "unsupported architecture"),
     ("no-such-model", "no model folder")],
)
def test_load_refusals(daemon_ab: DaemonProc, ref: str, needle: str) -> None:
    out = ctl(daemon_ab, "load-model", ref)
    assert out.returncode == 1, out
    assert needle in out.stderr
    assert greedy(daemon_ab)[0] == "alpha"  # still serving


def test_failed_load_keeps_old_model(daemon_ab: DaemonProc) -> None:
    d = daemon_ab
    out = ctl(d, "load-model", "bad-shapes", "--wait")
    assert out.returncode == 1 and "load failed" in out.stderr
    s = json.loads(ctl(d, "status", "--json").stdout)
    assert s["model"]["served_name"] == "alpha" and s["load"]["error"] and s["state"] == "ready"
    assert greedy(d)[0] == "alpha"


def test_unreachable_and_permission_denied(daemon_ab: DaemonProc, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "--socket", str(tmp_path / "none.sock"), "status"],
                         capture_output=True, text=True, env=daemon_env())
    assert out.returncode == 2 and "no daemon socket" in out.stderr
    assert oct(os.stat(daemon_ab.uds).st_mode & 0o777) == "0o660"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root and setpriv to act as an unprivileged user")
    out = ctl(daemon_ab, "status", user="65534")  # nobody: neither owner nor in the socket's group
    assert out.returncode == 2 and "permission denied" in out.stderr
    out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "frobnicate"], capture_output=True, text=True, env=daemon_env())
    assert out.returncode == 2


def test_admin_over_tcp_needs_admin_key(models_dir: Path) -> None:
    d = start_daemon(models_dir / "alpha", "--server.admin_api_key", "adm-secret-123")
    try:
        assert httpx.get(f"{d.base_url}/admin/status").status_code == 401
        r = httpx.get(f"{d.base_url}/admin/status", headers={"Authorization": "Bearer adm-secret-123"})
        assert r.status_code == 200 and r.json()["state"] == "ready"
        assert "adm-secret-123" not in r.text  # secrets are redacted in the status
        out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "--url", d.base_url, "--admin-key", "adm-secret-123",
                              "status"], capture_output=True, text=True, env=daemon_env())
        assert out.returncode == 0 and "ready" in out.stdout
    finally:
        stop_and_check(d)
    d = start_daemon(models_dir / "alpha")
    try:
        r = httpx.get(f"{d.base_url}/admin/status")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    finally:
        stop_and_check(d)


def _parse_metrics(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


def test_metrics_move_with_requests(daemon_ab: DaemonProc) -> None:
    d = daemon_ab

    def value(m: dict[str, list[Any]], sample: str) -> float:
        return sum(s.value for samples in m.values() for s in samples if s.name == sample)

    before = _parse_metrics(httpx.get(f"{d.base_url}/metrics").text)
    for _ in range(3):
        greedy(d, max_tokens=5)
    time.sleep(0.2)
    after = _parse_metrics(httpx.get(f"{d.base_url}/metrics").text)
    assert value(after, "mllmd_generation_tokens_total") - value(before, "mllmd_generation_tokens_total") == 15
    assert value(after, "mllmd_request_success_total") - value(before, "mllmd_request_success_total") == 3
    assert value(after, "mllmd_prompt_tokens_total") > value(before, "mllmd_prompt_tokens_total")
    assert value(after, "mllmd_time_to_first_token_seconds_count") - value(before, "mllmd_time_to_first_token_seconds_count") == 3
    assert value(after, "mllmd_up") == 1
    info = [s for s in after["mllmd_model_info"] if s.value == 1]
    assert info and info[0].labels["model_name"] == "alpha" and info[0].labels["architecture"] == "Qwen3ForCausalLM"
    assert "mllmd_memory_total_bytes" in after  # procfs is always there
    assert "mllmd_gpu_utilization_ratio" not in after  # no GPU source here: omitted, not 0


def test_hot_swap_under_load_and_restart_memory(models_dir: Path, tmp_path: Path) -> None:
    workdir_env = {"STATE_DIRECTORY": str(tmp_path / "state")}
    d = start_daemon(models_dir / "alpha", env=workdir_env)
    try:
        _, text_alpha = greedy(d)
        assert ctl(d, "load-model", "beta", "--wait").returncode == 0
        _, text_beta = greedy(d)
        assert text_alpha != text_beta
        outputs: list[tuple[int, str, str]] = []
        stop = threading.Event()

        def client() -> None:
            with d.http(timeout=60) as http:
                while not stop.is_set():
                    chunks, model = [], ""
                    with http.stream("POST", "/v1/chat/completions", json={
                            "messages": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
                        if r.status_code != 200:
                            outputs.append((r.status_code, "", r.read().decode()))
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                obj = json.loads(line[6:])
                                model = obj["model"]
                                for c in obj["choices"]:
                                    chunks.append(c["delta"].get("content") or "")
                    outputs.append((200, model, "".join(chunks)))

        def finished_by_model() -> dict[str, float]:
            out: dict[str, float] = {}
            for sm in _parse_metrics(httpx.get(f"{d.base_url}/metrics").text).get("mllmd_request_success", []):
                if sm.name == "mllmd_request_success_total":
                    out[sm.labels["model_name"]] = out.get(sm.labels["model_name"], 0) + sm.value
            return out

        before = finished_by_model()
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        for target in ("alpha", "beta", "alpha"):
            assert ctl(d, "load-model", target, "--wait").returncode == 0
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(60)
        assert len(outputs) >= 4
        failed = [o for o in outputs if o[0] != 200]
        assert not failed, failed
        expected = {"alpha": text_alpha, "beta": text_beta}
        for _, model, text in outputs:
            assert text == expected[model], f"a response mixed models or diverged: {model!r} {text!r}"
        assert {m for _, m, _ in outputs} == {"alpha", "beta"}
        # each request counts under the model that served it, also when it finished after a swap began
        after = finished_by_model()
        for name in ("alpha", "beta"):
            served = sum(1 for _, m, _ in outputs if m == name)
            assert after.get(name, 0) - before.get(name, 0) == served, (name, before, after, len(outputs))
    finally:
        stop_and_check(d)
    # A restart with the same configuration comes back with the last loaded model (alpha).
    d2 = start_daemon(models_dir / "alpha", env=workdir_env)
    try:
        assert greedy(d2)[0] == "alpha"
        assert ctl(d2, "load-model", "beta", "--wait").returncode == 0
    finally:
        stop_and_check(d2)
    d3 = start_daemon(models_dir / "alpha", env=workdir_env)
    try:
        assert greedy(d3)[0] == "beta"
        assert ctl(d3, "unload-model").returncode == 0
        assert d3.wait_health(503, 30)["state"] == "idle"
    finally:
        stop_and_check(d3)


def test_fake_tegrastats_drives_metrics(models_dir: Path) -> None:
    """A fake tegrastats on the configured path feeds the Jetson gauges of /metrics end to end."""
    fake = Path(__file__).resolve().parents[1] / "telemetry" / "fake_tegrastats"
    d = start_daemon(models_dir / "alpha", "--telemetry.tegrastats_path", str(fake), "--telemetry.interval", "0.2")
    try:
        deadline = time.monotonic() + 20
        metrics: dict[str, list[Any]] = {}
        while time.monotonic() < deadline:
            metrics = _parse_metrics(httpx.get(f"{d.base_url}/metrics").text)
            if "mllmd_gpu_utilization_ratio" in metrics:
                break
            time.sleep(0.3)
        for name in ("mllmd_gpu_utilization_ratio", "mllmd_gpu_frequency_hertz", "mllmd_temperature_celsius",
                     "mllmd_power_watts", "mllmd_emc_frequency_hertz", "mllmd_swap_total_bytes"):
            assert name in metrics, f"{name} missing: {sorted(metrics)}"
        assert all(0 <= s.value <= 1 for s in metrics["mllmd_gpu_utilization_ratio"])
        assert json.loads(ctl(d, "status", "--json").stdout)["telemetry_sources"] == ["procfs", "tegrastats"]
    finally:
        stop_and_check(d)


def test_sighup_and_reload_apply_live_keys(models_dir: Path, tmp_path: Path) -> None:
    import signal

    cfg = tmp_path / "mllmd.yaml"
    cfg.write_text("server:\n  max_queued_requests: 7\n")
    d = start_daemon(models_dir / "alpha", "--config", str(cfg))
    try:
        assert json.loads(ctl(d, "status", "--json").stdout)["config"]["server"]["max_queued_requests"] == 7
        cfg.write_text("server:\n  max_queued_requests: 9\n  port: 1\nscheduler:\n  max_running_requests: 3\n")
        # (port: 1 is also on the command line, which wins over the file: it does not change)
        os.kill(d.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while json.loads(ctl(d, "status", "--json").stdout)["config"]["server"]["max_queued_requests"] != 9:
            assert time.monotonic() < deadline, d.log_tail()
            time.sleep(0.2)
        status = json.loads(ctl(d, "status", "--json").stdout)
        assert status["config"]["server"]["port"] == d.port
        # read at a model load: the model serving keeps its value, the next load takes the new one
        assert status["model"]["max_running_requests"] != 3
        cfg.write_text("server:\n  max_queued_requests: 11\nscheduler:\n  max_running_requests: 3\n"
                       "telemetry:\n  interval: 2.5\n")
        r = d.uds_http().post("/admin/reload")
        body = r.json()
        assert r.status_code == 200 and body["applied"] == ["server.max_queued_requests"]
        assert body["needs_restart"] == ["telemetry.interval"] and body["next_load"] == [], body  # 3 kept from before
        assert ctl(d, "load-model", "alpha", "--wait").returncode == 0
        assert json.loads(ctl(d, "status", "--json").stdout)["model"]["max_running_requests"] == 3
        cfg.write_text("server:\n  max_queued_requests: -5\n")
        r = d.uds_http().post("/admin/reload")
        assert r.status_code == 400 and "max_queued_requests" in r.json()["error"]["message"]
        assert d.health()[0] == 200
    finally:
        stop_and_check(d)


def test_reload_rereads_the_key_file_and_refuses_a_conflict(models_dir: Path, tmp_path: Path) -> None:
    """Keys rotated in server.api_key_file apply at a reload (the file's path did not change); a new
    configuration that conflicts with the rest (an API key equal to the admin key) is a 400 that changes
    nothing, and SIGHUP survives it."""
    import signal

    keys, cfg = tmp_path / "keys", tmp_path / "mllmd.yaml"
    keys.write_text("sk-old-key-1\n")
    cfg.write_text(f"server:\n  api_key_file: {keys}\n  admin_api_key: sk-admin-key-1\n")
    d = start_daemon(models_dir / "alpha", "--config", str(cfg))
    try:
        def models(key: str) -> int:
            return httpx.get(f"{d.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

        assert models("sk-old-key-1") == 200 and models("sk-new-key-2") == 401
        keys.write_text("sk-new-key-2\n")
        cfg.write_text(f"server:\n  api_key_file: {keys}\n  admin_api_key: sk-admin-key-1\n"
                       "  max_request_bytes: 200000\n  body_timeout: 7\n")
        r = d.uds_http().post("/admin/reload")
        assert r.status_code == 200, r.text
        assert r.json()["applied"] == ["server.api_key_file", "server.body_timeout", "server.max_request_bytes"]
        conns = json.loads(ctl(d, "status", "--json").stdout)["connections"]
        assert conns["body_bytes_limit"] == 8 * 200000, conns  # the bodies in flight follow the new limit
        assert models("sk-new-key-2") == 200 and models("sk-old-key-1") == 401
        keys.write_text("sk-admin-key-1\n")  # the admin key as an API key: refused, nothing changes
        r = d.uds_http().post("/admin/reload")
        assert r.status_code == 400 and "admin_api_key" in r.json()["error"]["message"], r.text
        assert models("sk-new-key-2") == 200 and models("sk-admin-key-1") == 401
        os.kill(d.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "the configuration is invalid" not in d.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, d.log_tail()
            time.sleep(0.1)
        assert d.health()[0] == 200 and models("sk-new-key-2") == 200
    finally:
        stop_and_check(d)
