"""mllmctl without a usable daemon: exit status 2 and a message that names the problem and the fix.

No daemon runs here: a missing socket, a socket nobody listens on (left by a killed daemon), a path
that is not a socket, a refused TCP port and bad arguments.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mllmd.ctl import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture
def stale_socket(tmp_path: Path) -> Iterator[Path]:
    """A bound Unix socket that does not listen: what a SIGKILLed daemon leaves behind."""
    path = tmp_path / "mllmd.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    yield path
    s.close()


def test_missing_socket_says_how_to_start(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run(capsys, "--socket", str(tmp_path / "none.sock"), "status")
    assert code == 2
    assert "no daemon socket" in err and "systemctl start mllmd" in err and "--socket" in err


def test_stale_socket_says_the_daemon_is_not_running(
    capsys: pytest.CaptureFixture[str], stale_socket: Path
) -> None:
    code, err = run(capsys, "--socket", str(stale_socket), "status")
    assert code == 2
    assert "mllmd is not running" in err and "systemctl start mllmd" in err, err
    assert "Errno" not in err


def test_a_path_that_is_not_a_socket(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "mllmd.yaml"
    f.write_text("{}\n")
    code, err = run(capsys, "--socket", str(f), "status")
    assert code == 2 and "is not a Unix socket" in err, err


def test_refused_tcp_port_names_the_address(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago and nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = run(capsys, "--url", f"http://127.0.0.1:{port}", "--admin-key", "k", "status")
    assert code == 2 and f"nothing listens at http://127.0.0.1:{port}" in err, err


@pytest.mark.parametrize(
    "url", ["127.0.0.1:30000", "localhost", "ftp://host", "http://127.0.0.1:99999", "http://[::1"]
)
def test_bad_url_is_a_usage_error(capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, err = run(capsys, "--url", url, "status")
    assert code == 2 and "--url" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ("--timeout", "0", "status"),
        ("--timeout", "-1", "status"),
        ("--timeout", "soon", "status"),
        ("load-model", "m", "--wait", "--wait-timeout", "0"),
    ],
)
def test_timeouts_must_be_positive(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    code, err = run(capsys, "--socket", "/nonexistent.sock", *argv)
    assert code == 2 and "timeout" in err and "seconds" in err, err
