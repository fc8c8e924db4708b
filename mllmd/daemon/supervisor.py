"""Supervisor: spawns the workers, watches their exits and heartbeats, restarts them with backoff.

A worker that exits, reports a fatal error, or misses heartbeats (a SIGSTOPped process sends none)
is killed and restarted after an exponential backoff. More than `max_restarts` restarts within
`restart_window` seconds leaves the daemon `degraded` (HTTP stays up; status says why). A worker
that cannot even be started (no file descriptors left, no memory: Popen raises) is retried with the
same backoff, without counting as a crash: it is the machine, not the worker; the error is logged
rate-limited and shown in status.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mllmd.daemon.ratelimit import RateLimitedLog
from mllmd.messages import Heartbeat, WorkerFatal, WorkerReady
from mllmd.workers import ipc

logger = logging.getLogger("mllmd.supervisor")
_errors = RateLimitedLog(logger)


@dataclass
class WorkerPolicy:
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    max_restarts: int = 5
    restart_window: float = 300.0
    ready_timeout: float = 600.0


@dataclass
class WorkerHandle:
    name: str
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    last_heartbeat: float = 0.0
    ready: bool = False
    ready_info: WorkerReady | None = None
    restarts: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    next_start: float = 0.0
    backoff: float = 0.0
    last_error: str | None = None
    requests: int | None = None  # requests it holds state for (from its last heartbeat)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Owns the worker processes of one loaded model."""

    def __init__(
        self,
        ipc_dir: Path,
        settings: dict[str, Any],
        policy: WorkerPolicy,
        on_worker_lost: Callable[[str, str], None],
    ) -> None:
        self.ipc_dir = ipc_dir
        self.policy = policy
        self.on_worker_lost = on_worker_lost
        self.settings_path = ipc_dir / "worker-settings.json"
        self.settings_path.write_text(json.dumps(settings))
        os.chmod(self.settings_path, 0o600)
        self.workers = {name: WorkerHandle(name) for name in ipc.WORKERS}
        self.degraded_reason: str | None = None
        self.degraded_worker: str | None = None  # the worker that gave up (named in public reasons)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start_all(self) -> None:
        for handle in self.workers.values():
            self._spawn(handle)

    def _spawn(self, h: WorkerHandle) -> None:
        argv = [
            sys.executable, "-m", f"mllmd.workers.{h.name}_worker",
            "--ipc-dir", str(self.ipc_dir), "--settings", str(self.settings_path),
        ]
        h.ready, h.requests = False, None
        try:
            h.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=False)
        except (OSError, subprocess.SubprocessError) as e:  # EMFILE, ENOMEM, EAGAIN: try again later
            now = time.monotonic()
            h.proc = None
            h.backoff = min(self.policy.backoff_max, max(self.policy.backoff_initial, h.backoff * 2))
            h.next_start = now + h.backoff
            h.last_error = f"cannot start the {h.name} worker: {e}"
            _errors.log(f"spawn:{h.name}", logging.ERROR, "%s; retrying in %.1f s", h.last_error, h.backoff)
            return
        h.started_at = h.last_heartbeat = time.monotonic()
        logger.info("started %s worker (pid %d)", h.name, h.proc.pid)

    def stop_all(self, timeout: float = 5.0) -> None:
        for h in self.workers.values():
            if h.alive():
                assert h.proc is not None
                h.proc.send_signal(signal.SIGCONT)
                h.proc.terminate()
        deadline = time.monotonic() + timeout
        for h in self.workers.values():
            if h.proc is None:
                continue
            try:
                h.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait()

    @property
    def all_ready(self) -> bool:
        return all(h.ready and h.alive() for h in self.workers.values())

    # ---- messages from workers ---------------------------------------------------------------
    def on_message(self, msg: Heartbeat | WorkerReady | WorkerFatal) -> None:
        h = self.workers.get(msg.worker)
        if h is None or h.pid != msg.pid:
            return  # a late message from a replaced process
        now = time.monotonic()
        if isinstance(msg, Heartbeat):
            h.last_heartbeat = now
            h.requests = msg.requests
        elif isinstance(msg, WorkerReady):
            h.ready, h.ready_info, h.last_heartbeat = True, msg, now
            h.backoff = 0.0
        else:
            h.last_error = msg.message

    # ---- periodic check ----------------------------------------------------------------------
    def check(self) -> None:
        """Detect dead or hung workers, kill and schedule restarts; start due restarts."""
        now = time.monotonic()
        for h in self.workers.values():
            try:
                self._check_one(h, now)
            except Exception:  # never let one worker's trouble stop the checks of the others
                _errors.exception(f"check:{h.name}", "checking the %s worker failed", h.name)

    def _check_one(self, h: WorkerHandle, now: float) -> None:
        if h.proc is None:
            if self.degraded_reason is None and now >= h.next_start:
                self._spawn(h)
            return
        code = h.proc.poll()
        limit = self.policy.heartbeat_timeout if h.ready else self.policy.ready_timeout
        if code is not None:
            reason = f"{h.name} worker exited with status {code}" + (f": {h.last_error}" if h.last_error else "")
        elif now - h.last_heartbeat > limit:
            reason = f"{h.name} worker sent no heartbeat for {now - h.last_heartbeat:.1f} s"
            h.proc.kill()
            h.proc.wait()
        elif not h.ready and now - h.started_at > self.policy.ready_timeout:
            # its heartbeat thread runs from the start: a load that hangs still beats
            reason = (f"{h.name} worker did not become ready within {self.policy.ready_timeout:g} s "
                      "(workers.ready_timeout)")
            h.proc.kill()
            h.proc.wait()
        else:
            return
        self._lost(h, reason, now)

    def _lost(self, h: WorkerHandle, reason: str, now: float) -> None:
        h.proc, h.ready = None, False
        h.last_error = reason  # kept in status after a restart (the log is not the only place it is)
        h.restart_times.append(now)
        while h.restart_times and now - h.restart_times[0] > self.policy.restart_window:
            h.restart_times.popleft()
        h.backoff = min(self.policy.backoff_max, max(self.policy.backoff_initial, h.backoff * 2))
        h.next_start = now + h.backoff
        if len(h.restart_times) > self.policy.max_restarts:
            self.degraded_reason = (
                f"{reason}; {len(h.restart_times) - 1} restarts within {self.policy.restart_window:.0f} s already, "
                "giving up"
            )
            self.degraded_worker = h.name
            logger.error("degraded: %s", self.degraded_reason)  # no restart: `restarts` counts those made
        else:
            logger.error("%s; restarting", reason)
            h.restarts += 1
        self.on_worker_lost(h.name, reason)

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "name": h.name,
                "pid": h.pid,
                "alive": h.alive(),
                "ready": h.ready,
                "restarts": h.restarts,
                "seconds_since_heartbeat": round(now - h.last_heartbeat, 3) if h.proc is not None else None,
                "last_error": h.last_error,
                "requests": h.requests,
            }
            for h in self.workers.values()
        ]
