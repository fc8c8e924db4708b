"""Issue 35, item 12: a second daemon never takes over a live daemon's Unix socket (nor deletes it
when it exits); a stale socket file (its daemon was killed) is replaced."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.conftest import daemon_env, short_tmpdir, start_daemon, stop_and_check

from .helpers import status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_second_daemon_leaves_a_live_socket_alone(tiny_model: Path) -> None:
    """Before: the second daemon unlinked the live socket, bound its own, and deleted it when it exited:
    mllmctl then said no daemon ran while the first still served TCP."""
    path = str(short_tmpdir() / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on: what a killed daemon leaves
    stale.close()
    first = start_daemon(tiny_model, "--server.unix_socket", path)
    first.uds = path
    try:
        ident = os.stat(path).st_ino
        second = start_daemon(tiny_model, "--server.unix_socket", path, wait=False)
        try:
            code = second.proc.wait(60)
        finally:
            second.kill_group()
        log = second.log_path.read_text()
        assert code == 1 and "another daemon is listening" in log, log[-2000:]
        assert os.stat(path).st_ino == ident
        assert status(first)["state"] == "ready"
        out = subprocess.run([sys.executable, "-m", "mllmd.ctl", "--socket", path, "status"], capture_output=True,
                             text=True, timeout=60, env=daemon_env())
        assert out.returncode == 0 and "ready" in out.stdout, out
    finally:
        stop_and_check(first)
    assert not os.path.exists(path), "the daemon left its own socket behind"
