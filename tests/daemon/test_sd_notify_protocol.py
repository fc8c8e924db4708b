"""sd_notify(3) messages as systemd parses them: one datagram per message, read from a bound socket."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mllmd.daemon.sd_notify import Notifier, reloading_message, watchdog_usec

from .conftest import short_tmpdir


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = Path(short_tmpdir()) / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5.0)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_reloading_carries_monotonic_usec_in_the_same_datagram(notify_socket: socket.socket) -> None:
    """systemd 253+ matches RELOADING=1 to its SIGHUP by MONOTONIC_USEC= (CLOCK_MONOTONIC, in the
    same message); a bare RELOADING=1 cannot be matched."""
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    Notifier().reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = dict(line.split("=", 1) for line in notify_socket.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1"
    assert before <= int(fields["MONOTONIC_USEC"]) <= after


def test_reloading_message_format() -> None:
    assert reloading_message(12_345_678_901) == "RELOADING=1\nMONOTONIC_USEC=12345678"


def test_watchdog_only_for_the_process_named_by_watchdog_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """sd_watchdog_enabled(3): WATCHDOG_PID, when set, names the process that must ping."""
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_usec() == 30_000_000
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_usec() == 30_000_000
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_usec() is None
