"""The HTTP layer's middleware on a bare Starlette app: request ids, the access log, CORS, JSON logs."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mllmd import logfmt
from mllmd.daemon.access import MAX_REQUEST_ID, RequestContext, sanitize_request_id
from mllmd.daemon.cors import CORS


def app(origins: tuple[str, ...] = ()) -> TestClient:
    async def hello(request: Any) -> JSONResponse:
        logging.getLogger("mllmd.test").warning("inside")
        return JSONResponse({"request_id": logfmt.request_id.get()})

    middleware = [Middleware(RequestContext), Middleware(CORS, origins=origins)]
    return TestClient(Starlette(routes=[Route("/x", hello, methods=["GET", "POST"])], middleware=middleware))


def test_request_id_sanitised() -> None:
    assert sanitize_request_id(b"abc-123_X.y") == "abc-123_X.y"
    assert sanitize_request_id(b"x" * MAX_REQUEST_ID) == "x" * MAX_REQUEST_ID
    for bad in (None, b"", b"x" * (MAX_REQUEST_ID + 1), b"a b", b"caf\xc3\xa9", b"a\x7f", b"a\tb"):
        got = sanitize_request_id(bad)
        assert len(got) == 32 and got != bad


def test_request_id_set_for_the_handler_and_returned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mllmd.access")
    c = app()
    r = c.get("/x", headers={"X-Request-Id": "abc"})
    assert r.json() == {"request_id": "abc"} and r.headers["x-request-id"] == "abc"
    assert logfmt.request_id.get() == "-"  # reset once the request is over
    access = [rec for rec in caplog.records if rec.name == "mllmd.access"]
    assert access and access[-1].status == 200 and access[-1].route == "/x"  # type: ignore[attr-defined]


def test_cors_off_by_default_and_for_unlisted_origins() -> None:
    for c, origin in ((app(), "http://a"), (app(("http://a",)), "http://b")):
        r = c.options("/x", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 405 and not any(k.startswith("access-control-") for k in r.headers)
        r = c.get("/x", headers={"Origin": origin})
        assert not any(k.startswith("access-control-") for k in r.headers)


def test_cors_allowed_origin_and_wildcard() -> None:
    for origins in (("http://a",), ("*",)):
        c = app(origins)
        r = c.options("/x", headers={"Origin": "http://a", "Access-Control-Request-Method": "POST"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://a"
        assert r.headers["x-request-id"]  # the preflight is a request like any other
        r = c.post("/x", headers={"Origin": "http://a"})
        assert r.headers["access-control-allow-origin"] == "http://a" and r.headers["vary"] == "Origin"


def test_cors_origins_compare_case_insensitively() -> None:
    """An origin configured with capitals (as browser_guard's CSRF check already allows it) gets its CORS
    headers: browsers send scheme and host in lower case."""
    c = app(("http://WebUI.lan:8080/",))
    r = c.post("/x", headers={"Origin": "http://webui.lan:8080"})
    assert r.headers["access-control-allow-origin"] == "http://webui.lan:8080"


def test_json_formatter_one_object_per_line() -> None:
    fmt = logfmt.JsonFormatter("mllmd")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        rec = logging.LogRecord("mllmd.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    rec.route = "/v1/chat/completions"
    token = logfmt.request_id.set("rid-1")
    try:
        line = fmt.format(rec)
    finally:
        logfmt.request_id.reset(token)
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "failed here" and out["request_id"] == "rid-1" and out["level"] == "ERROR"
    assert out["route"] == "/v1/chat/completions" and "ValueError: boom" in out["exception"]
