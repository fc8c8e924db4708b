"""sd_notify(3) for the daemon's main process: READY, STATUS, RELOADING, STOPPING and WATCHDOG.

systemd 253+ (Type=notify-reload, and the reload bookkeeping of Type=notify) ties a reload to the
RELOADING=1 that carries MONOTONIC_USEC=, the CLOCK_MONOTONIC time the reload began; without it the
message cannot be matched to the SIGHUP systemd sent. Older systemd ignores the extra field.
"""

from __future__ import annotations

import os
import time

from mllmd import knobs

__all__ = ["Notifier", "reloading_message", "watchdog_usec"]


def reloading_message(monotonic_ns: int | None = None) -> str:
    """RELOADING=1 with MONOTONIC_USEC= (now on CLOCK_MONOTONIC unless given), in one datagram."""
    ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if monotonic_ns is None else monotonic_ns
    return f"RELOADING=1\nMONOTONIC_USEC={ns // 1000}"


def watchdog_usec() -> int | None:
    """The watchdog interval meant for this process: $WATCHDOG_USEC, unless $WATCHDOG_PID names
    another process (sd_watchdog_enabled(3): a child that inherited the variables must not ping)."""
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    return knobs.watchdog_usec()


class Notifier:
    """sd_notify (a no-op outside systemd)."""

    def __init__(self) -> None:
        import sdnotify

        self._n = sdnotify.SystemdNotifier() if knobs.notify_socket() else None

    def send(self, line: str) -> None:
        """Send one message (several `KEY=VALUE` lines go in one datagram)."""
        if self._n is not None:
            self._n.notify(line)

    def reloading(self) -> None:
        """A reload began (RELOADING=1 with its MONOTONIC_USEC=); READY=1 ends it."""
        self.send(reloading_message())
