"""A long-lived ``tegrastats --interval N`` child (Jetson) read line by line on a thread.

``N`` is in milliseconds, as tegrastats wants it. Each line goes through
:func:`mllmd.telemetry.tegrastats.parse_line`; the newest sample is kept with its arrival time.
When the child exits it is restarted after a backoff that doubles from ``backoff_initial`` up to
``backoff_max`` (and returns to ``backoff_initial`` after a run that lasted at least
``backoff_max`` and produced samples). A child that prints nothing for ``hang_after`` seconds is
killed by :meth:`check_hung` and so restarted too. The daemon never depends on it: with no binary,
or while the child is down, :meth:`latest` returns None and the other sources fill in.
Standard library only (no torch).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

from mllmd.telemetry.tegrastats import TegrastatsSample, parse_line

__all__ = ["TegrastatsSource", "resolve_tegrastats"]

logger = logging.getLogger("mllmd.telemetry")


def resolve_tegrastats(path: str) -> str | None:
    """The executable to run: `path` if it is an executable file, else its name looked up on PATH."""
    if not path:
        return None
    if os.sep in path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return shutil.which(os.path.basename(path))


class TegrastatsSource:
    """Runs and re-runs tegrastats; :meth:`latest` gives the newest parsed sample."""

    def __init__(
        self,
        path: str,
        interval_s: float,
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        hang_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.interval_ms = max(1, round(interval_s * 1000))
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.hang_after = hang_after if hang_after is not None else max(10 * interval_s, 10.0)
        self.clock = clock
        self.starts = 0  # children started so far (restarts = starts - 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._sample: TegrastatsSample | None = None
        self._sample_at = 0.0
        self._output_at = 0.0
        self._thread: threading.Thread | None = None

    @property
    def argv(self) -> list[str]:
        return [self.path, "--interval", str(self.interval_ms)]

    @property
    def pid(self) -> int | None:
        """The running child's pid, or None while it is down."""
        with self._lock:
            proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the reader thread (which starts the child)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mllmd-tegrastats", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the child and the thread."""
        with self._lock:
            self._stop.set()
            proc = self._proc
        if proc is not None:
            _end(proc, timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def latest(self, max_age: float | None = None) -> TegrastatsSample | None:
        """The newest sample, or None if there is none or it is older than `max_age` seconds."""
        with self._lock:
            sample, at = self._sample, self._sample_at
        if sample is None or (max_age is not None and self.clock() - at > max_age):
            return None
        return sample

    def check_hung(self) -> bool:
        """Kill a child that has printed nothing for `hang_after` seconds; True if one was killed."""
        with self._lock:
            proc, last = self._proc, self._output_at
        if proc is None or proc.poll() is not None or self.clock() - last <= self.hang_after:
            return False
        logger.warning("tegrastats printed nothing for %.0f s: killing it (pid %d)", self.hang_after, proc.pid)
        proc.kill()
        return True

    # ---- the reader thread --------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.backoff_initial
        while not self._stop.is_set():
            started = self.clock()
            produced, last_other = self._run_once()
            if self._stop.is_set():
                break
            if produced and self.clock() - started >= self.backoff_max:
                backoff = self.backoff_initial
            hint = f" (last output: {last_other!r})" if last_other else ""
            logger.warning("tegrastats stopped%s; restarting in %.1f s", hint, backoff)
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, self.backoff_max)

    def _run_once(self) -> tuple[bool, str]:
        """Run one child until it exits: (whether it produced a sample, its last non-sample line)."""
        try:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, encoding="utf-8", errors="replace", bufsize=1,
            )
        except OSError as e:
            return False, str(e)
        with self._lock:
            self._proc = proc
            self._output_at = self.clock()
            self.starts += 1
            stopping = self._stop.is_set()
        if stopping:
            _end(proc, 1.0)
        else:
            logger.info("tegrastats started (pid %d): %s", proc.pid, " ".join(self.argv))
        produced, last_other = False, ""
        assert proc.stdout is not None
        for line in proc.stdout:
            sample = parse_line(line)
            now = self.clock()
            with self._lock:
                self._output_at = now
                if sample is not None:
                    self._sample, self._sample_at = sample, now
            if sample is not None:
                produced = True
            elif line.strip():
                last_other = line.strip()[:200]
        proc.stdout.close()
        rc = proc.wait()
        with self._lock:
            self._proc = None
        if not last_other and rc:
            last_other = f"exit status {rc}"
        return produced, last_other


def _end(proc: subprocess.Popen[str], timeout: float) -> None:
    """Terminate, then kill if it lingers."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
