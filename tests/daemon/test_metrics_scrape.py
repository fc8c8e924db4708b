"""/metrics of a real daemon after ordinary and hostile traffic: lint-clean (promtool where installed,
always mllmd.testing.promlint), no secret or path in it, and no series a client can add."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mllmd.testing.promlint import label_values, lint

from .conftest import DaemonProc, start_daemon, stop_and_check

pytestmark = pytest.mark.timeout(300)
API_KEY = "sk-test-" + "9f" * 16
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed(tiny_model: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tiny_model, api_key=API_KEY)
    yield d
    stop_and_check(d)


def png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ordinary(c: httpx.Client) -> None:
    """Chat, completion, a stream, a stream the client leaves, /generate."""
    assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}).status_code == 200
    assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}).status_code == 200
    body = {"messages": CHAT, "max_tokens": 4, "stream": True}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 0
    with c.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 400}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # the client leaves: an abort
    assert (
        c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    )


def hostile(c: httpx.Client, tag: str) -> None:
    """Requests whose model names, paths, headers and bodies are the client's own, all refused."""
    for i in range(3):
        name = f"{tag}-{i}-{uuid.uuid4().hex}"
        r = c.post("/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 404
        assert c.get(f"/v1/{name}").status_code == 404
        assert c.post(f"/v1/models/{name}").status_code in (404, 405)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": name})
        assert r.status_code == 200
    assert (
        c.post(
            "/v1/chat/completions", content=b"{nope", headers={"Content-Type": "application/json"}
        ).status_code
        == 400
    )
    assert httpx.post(f"{c.base_url}/v1/chat/completions", json={"messages": CHAT}).status_code == 401
    image = [{"type": "image_url", "image_url": {"url": png_data_url()}}, {"type": "text", "text": "?"}]
    r = c.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": image}], "max_tokens": 2}
    )
    assert r.status_code == 400  # a text-only model refuses images
    r = c.post("/v1/completions", json={"prompt": "hi " * 50000, "max_tokens": 2})
    assert r.status_code == 400


def series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_after_traffic_are_clean_and_bounded(keyed: DaemonProc) -> None:
    d = keyed
    with d.http() as c:
        ordinary(c)
        hostile(c, "first")
        first = httpx.get(f"{d.base_url}/metrics", timeout=30)  # no key needed by default
        assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain")
        text = first.text
        assert lint(text) == []
        assert API_KEY not in text and str(d.model_path) not in text
        values = label_values(text, ["model_name", "reason", "finished_reason", "hop", "worker"])
        assert values["model_name"] == {d.model_path.name}
        assert values["reason"] <= {"aborted", "rejected", "error"}
        assert values["finished_reason"] <= {"stop", "length", "abort", "tool_calls"}
        assert values["worker"] <= {"tokenizer", "scheduler", "detokenizer"}
        hostile(c, "second")  # new names, paths and ids: no new series
        again = httpx.get(f"{d.base_url}/metrics", timeout=30).text
        assert series(again) == series(text)
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt install prometheus); the pure-Python lint passed")
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout,
        done.stderr,
    )
