"""Issue 35, items 8 and 13, and what /health tells strangers: every path the admin API is given is
checked against model.models_dir (overrides too); a folder without a tokenizer is refused before a
load; an unauthenticated /health shows no filesystem detail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon.conftest import daemon_env, start_daemon, stop_and_check

from .helpers import admin, status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paths")
    models, outside = root / "models", root / "outside"
    models.mkdir()
    outside.mkdir()
    shutil.copytree(tiny_model, models / "alpha")
    shutil.copytree(tiny_model, outside / "elsewhere")
    (models / "escape").symlink_to(outside / "elsewhere")  # a link out of the models dir
    bare = models / "no-tokenizer"
    shutil.copytree(tiny_model, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    return {"models": models, "outside": outside}


@pytest.fixture(scope="module")
def d(dirs: dict[str, Path]) -> Any:
    daemon = start_daemon(dirs["models"] / "alpha")
    yield daemon
    stop_and_check(daemon)


def load(d: Any, body: Any) -> httpx.Response:
    return admin(d, "POST", "/admin/models/load", body)


def assert_refused(r: httpx.Response, *needles: str) -> dict[str, Any]:
    assert r.status_code == 422, (r.status_code, r.text)
    err = r.json()["error"]
    for n in needles:
        assert n in err["message"], err
    return err


def test_overrides_cannot_leave_the_models_dir(d: Any, dirs: dict[str, Path]) -> None:
    """Before: {"model": "tiny", "overrides": {"model_path": "/anywhere"}} loaded weights from outside
    the models dirs, recorded that path and loaded it again at boot; tokenizer_path was not checked."""
    elsewhere = str(dirs["outside"] / "elsewhere")
    err = assert_refused(load(d, {"model": "alpha", "overrides": {"model_path": elsewhere}}), "model_path")
    assert err["param"] == "overrides"
    assert_refused(load(d, {"model": "alpha", "overrides": {"tokenizer_path": elsewhere}}), "model.models_dir")
    assert_refused(load(d, {"model": "alpha", "overrides": {"tokenizer_path": "../outside/elsewhere"}}),
                   "model.models_dir")
    assert_refused(load(d, {"model": "alpha", "overrides": {"no_such": 1}}), "unknown model override")
    assert status(d)["model"]["served_name"] == "alpha" and not status(d)["load"]["in_progress"]


@pytest.mark.parametrize("ref", ["a\0b", "x" * 5000, "y" * 300, "/etc", "../outside/elsewhere", "escape",
                                 "./../outside/elsewhere", "/proc/self/cwd"])
def test_model_references_are_checked(d: Any, ref: str) -> None:
    """Before: a NUL byte or a 5,000-character name was a 500. Now every bad reference is a 422 that
    names the rule (model.models_dir for anything outside)."""
    r = load(d, {"model": ref})
    err = assert_refused(r)
    if ref in ("/etc", "../outside/elsewhere", "escape", "./../outside/elsewhere"):
        assert "model.models_dir" in err["message"], err
    assert status(d)["model"]["served_name"] == "alpha"


def test_mllmctl_names_the_models_dir(d: Any) -> None:
    out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "--socket", d.uds, "load-model", "/etc"],
                         capture_output=True, text=True, timeout=60, env=daemon_env())
    assert out.returncode == 1 and "model.models_dir" in out.stderr, out


def test_the_listing_does_not_follow_links_out(d: Any, dirs: dict[str, Path]) -> None:
    """Before: /admin/models listed (and read) a symlink pointing outside the models dirs."""
    r = admin(d, "GET", "/admin/models")
    assert r.status_code == 200
    by_name = {m["name"]: m for m in r.json()["models"]}
    assert by_name["alpha"]["error"] is None and by_name["alpha"]["parameters"] > 0
    escape = by_name["escape"]
    assert "outside model.models_dir" in escape["error"] and "parameters" not in escape
    assert str(dirs["outside"]) not in r.text
    assert "no usable tokenizer" in by_name["no-tokenizer"]["error"]


def test_a_folder_without_a_tokenizer_is_refused_before_loading(d: Any) -> None:
    """Before: it loaded as "ready" (transformers built an empty tokenizer) and every chat then failed
    with a 400 pointing at a download site."""
    err = assert_refused(load(d, {"model": "no-tokenizer"}), "no usable tokenizer", "tokenizer.json")
    assert err["param"] == "model"
    s = status(d)
    assert s["model"]["served_name"] == "alpha" and s["load"]["error"] is None


def test_health_shows_strangers_no_paths(dirs: dict[str, Path]) -> None:
    """A boot whose model cannot load: /health over TCP says so without the path or the error; the
    admin (Unix socket) gets the detail."""
    d = start_daemon(dirs["models"] / "no-tokenizer", wait=False)
    try:
        body = d.wait_health(503, 90)
        assert body["state"] == "idle" and "last load failed" in body["reason"]
        assert "/" not in body["reason"] and "tokenizer" not in body["reason"], body
        r = httpx.post(d.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and str(dirs["models"]) not in r.text
        detail = admin(d, "GET", "/health").json()
        assert str(dirs["models"]) in detail["reason"] and "tokenizer" in detail["reason"], detail
    finally:
        stop_and_check(d)
    assert os.path.isdir(dirs["models"] / "alpha")
