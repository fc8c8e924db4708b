"""Issue 35, items 7 and 11: the state record of the active model. Any content boots the daemon
(falling back to model.path, saying why); a load that cannot be recorded fails instead of being
reported done; the record is written atomically and durably."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mllmd.daemon.state import STATE_FILE, Record, StateError, probe, read_record, write_record
from tests.daemon.conftest import daemon_env, start_daemon, stop_and_check

from .helpers import admin, log_lines, status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CORRUPT: dict[str, bytes] = {
    "empty-list": b"[]",
    "null": b"null",
    "string": b'"/var/lib/mllmd/models/x"',
    "number": b"42",
    "numeric-path": b'{"path": 5, "overrides": {}, "boot_default": null}',
    "list-of-overrides": b'{"path": "/tmp", "overrides": [["dtype", "float16"]], "boot_default": null}',
    "empty": b"",
    "binary": bytes(range(256)) * 4,
    "truncated": b'{"path": "/tmp/x", "overr',
    "nul-in-path": b'{"path": "/tmp/\\u0000x", "overrides": {}, "boot_default": null}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "huge": b" " * (2 << 20) + b"{}",
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_any_content_reads_as_no_record_with_a_reason(tmp_path: Path, name: str) -> None:
    (tmp_path / STATE_FILE).write_bytes(CORRUPT[name])
    rec, why = read_record(tmp_path)
    assert rec is None and why, (rec, why)


def test_a_folder_or_a_dangling_link_in_place_of_the_record(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).mkdir()
    assert read_record(tmp_path)[0] is None and read_record(tmp_path)[1]
    with pytest.raises(StateError, match="is a folder"):
        probe(tmp_path)
    with pytest.raises(StateError):
        write_record(tmp_path, Record("/x"))
    assert not [p for p in tmp_path.iterdir() if p.name != STATE_FILE], "a temporary file was left behind"
    other = tmp_path / "b"
    other.mkdir()
    (other / STATE_FILE).symlink_to(other / "nowhere")
    assert read_record(other)[0] is None


def test_an_unwritable_state_folder_is_detected(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StateError, match="cannot record"):
        probe(blocker / "state")
    with pytest.raises(StateError, match="cannot record"):
        write_record(blocker / "state", Record("/x"))


def test_the_record_is_atomic_and_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temp file, fsync, rename, fsync of the folder; a failed rename leaves the old record whole."""
    write_record(tmp_path, Record("/models/a", {"dtype": "float32"}, None))
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_record(tmp_path, Record("/models/b", {}, None))
    assert synced == ["file", "dir"]
    assert read_record(tmp_path)[0] == Record("/models/b", {}, None)

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StateError, match="No space left"):
        write_record(tmp_path, Record("/models/c", {}, None))
    assert read_record(tmp_path)[0] == Record("/models/b", {}, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


def _daemon_boot_choice(tmp_path: Path, tiny_model: Path, content: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    from mllmd.daemon.config import load_config
    from mllmd.daemon.main import Daemon

    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / STATE_FILE).write_bytes(content)
    monkeypatch.setenv("STATE_DIRECTORY", str(state))
    cfg = load_config("/dev/null", {"model.path": str(tiny_model), "model.models_dir": [str(tiny_model.parent)]},
                      environ={})
    daemon = Daemon(cfg)
    try:
        return daemon._boot_model()
    finally:
        daemon.zctx.destroy(linger=0)


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_boot_falls_back_to_model_path(tmp_path: Path, tiny_model: Path, name: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: [] / null / a string / a numeric path / a list of overrides made the daemon exit 1 (and
    systemd's start limit kept it down). Now each boots model.path."""
    path, overrides, recorded = _daemon_boot_choice(tmp_path, tiny_model, CORRUPT[name], monkeypatch)
    assert (path, overrides, recorded) == (str(tiny_model), {}, False)


@pytest.mark.parametrize("record", [
    {"path": "/etc", "overrides": {}},  # outside model.models_dir
    {"path": "MODEL", "overrides": {"model_path": "/etc"}},  # an override of the model folder
    {"path": "MODEL", "overrides": {"tokenizer_path": "/etc"}},  # a tokenizer outside model.models_dir
    {"path": "MODEL", "overrides": {"no_such_setting": 1}},
    {"path": "/no/such/folder", "overrides": {}},
])
def test_a_record_that_cannot_be_used_boots_model_path(tmp_path: Path, tiny_model: Path, record: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    record = {**record, "path": str(tiny_model) if record["path"] == "MODEL" else record["path"],
              "boot_default": str(tiny_model)}
    path, overrides, recorded = _daemon_boot_choice(tmp_path, tiny_model, json.dumps(record).encode(), monkeypatch)
    assert (path, overrides, recorded) == (str(tiny_model), {}, False)


def test_the_daemon_boots_whatever_the_record_holds(tiny_model: Path, tmp_path: Path) -> None:
    """End to end, with the issue's first case ([]) and an override that validates but cannot load
    (the flashinfer backend on a CPU): both boot model.path and serve; the log says why."""
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_bytes(b"[]")
    d = start_daemon(tiny_model, env={"STATE_DIRECTORY": str(state)})
    try:
        assert status(d)["model"]["served_name"] == tiny_model.name
        assert any("ignoring" in ln and "JSON list" in ln for ln in log_lines(d))
    finally:
        stop_and_check(d)
    record = {"path": str(tiny_model), "overrides": {"attention_backend": "flashinfer"}, "boot_default": str(tiny_model)}
    (state / STATE_FILE).write_text(json.dumps(record))
    d = start_daemon(tiny_model, env={"STATE_DIRECTORY": str(state)}, ready_timeout=240)
    try:
        s = status(d)
        assert s["state"] == "ready" and s["model"]["served_name"] == tiny_model.name
        assert any("loading model.path" in ln for ln in log_lines(d)), d.log_tail()
    finally:
        stop_and_check(d)


def test_a_load_that_cannot_be_recorded_fails(tiny_model: Path, tmp_path: Path) -> None:
    """Before: with the state folder full or read-only, load-model answered 202, status said nothing,
    and the next restart silently served the previous model. Now the load is refused with the reason
    (here the record's place is taken by a folder, which no rename can replace), the running model
    keeps serving, and unload is refused too (it would come back at restart)."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(tiny_model, models / "alpha")
    shutil.copytree(tiny_model, models / "beta")
    state = tmp_path / "state"
    (state / STATE_FILE).mkdir(parents=True)
    (state / STATE_FILE / "x").write_text("x")
    d = start_daemon(models / "alpha", env={"STATE_DIRECTORY": str(state)})
    try:
        out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "--socket", d.uds, "load-model", "beta", "--wait"],
                             capture_output=True, text=True, timeout=120, env=daemon_env())
        assert out.returncode == 1 and "cannot record the active model" in out.stderr, out
        s = status(d)
        assert s["state"] == "ready" and s["model"]["served_name"] == "alpha" and not s["load"]["in_progress"]
        r = admin(d, "POST", "/admin/models/unload")
        assert r.status_code == 500 and "cannot record" in r.json()["error"]["message"], r.text
        assert status(d)["model"]["served_name"] == "alpha"
    finally:
        stop_and_check(d)
