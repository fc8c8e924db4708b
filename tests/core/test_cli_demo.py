"""`mllmd demo` keeps what it writes in the mllmd cache folder, never in the service's folders.

The demo is a development tool run from a checkout: its record of the loaded model (which a restart
loads again) must not go to the service's /var/lib/mllmd, where a demo run as root replaced the
service's record (a restart of the service then lost the model `mllmctl load-model` had chosen). No
daemon runs here: the demo model's build and the daemon itself are replaced by stand-ins.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from mllmd import cli, knobs


@pytest.fixture
def demo_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Run `mllmd demo` up to the daemon's start; returns what the daemon would have seen."""
    monkeypatch.setenv("MLLMD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STATE_DIRECTORY", "unset-below")  # so that the undo restores the caller's value
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.delenv("MLLMD_SERVER__UNIX_SOCKET", raising=False)
    model = tmp_path / "cache" / "models" / "mllmd-demo-random-weights"

    def fake_build(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert argv[1:] == ["-m", "mllmd.demo"]
        return subprocess.CompletedProcess(argv, 0, stdout=f"{model}\n", stderr="")

    seen: dict[str, Any] = {}

    def fake_run(config: Any) -> int:
        seen.update(state_dir=knobs.state_dir(), socket=config.server.unix_socket, path=config.model.path)
        return 0

    monkeypatch.setattr(subprocess, "run", fake_build)
    monkeypatch.setattr(cli, "_run", fake_run)
    seen["model"] = model
    return seen


def test_demo_records_its_model_in_the_cache_folder(demo_run: dict[str, Any], tmp_path: Path) -> None:
    assert cli.main(["demo", "--config", "/dev/null"]) == 0
    assert demo_run["path"] == str(demo_run["model"])
    assert demo_run["socket"] == str(tmp_path / "cache" / "mllmd-demo.sock")
    assert demo_run["state_dir"] == tmp_path / "cache" / "state"


def test_demo_keeps_a_state_directory_given(demo_run: dict[str, Any], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "mine"))
    assert cli.main(["demo", "--config", "/dev/null"]) == 0
    assert demo_run["state_dir"] == tmp_path / "mine"


def test_run_keeps_the_service_state_folder(demo_run: dict[str, Any]) -> None:
    assert cli.main(["run", "--config", "/dev/null"]) == 0
    assert demo_run["state_dir"] == Path("/var/lib/mllmd")
