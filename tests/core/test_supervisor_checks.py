"""The supervisor's checks of one worker, with a real (sleeping) child process and a fake clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mllmd.daemon.supervisor import Supervisor, WorkerPolicy


def test_a_worker_whose_load_hangs_is_killed_at_ready_timeout(tmp_path: Path) -> None:
    """A worker restarted inside a serving model keeps its heartbeat thread beating while its load
    hangs: heartbeats alone never ended it. Past workers.ready_timeout from its start it is killed and
    reported lost, naming the setting; a ready worker that beats is left alone."""
    lost: list[tuple[str, str]] = []
    sup = Supervisor(tmp_path, {}, WorkerPolicy(heartbeat_timeout=10.0, ready_timeout=60.0),
                     lambda name, reason: lost.append((name, reason)))
    name = next(iter(sup.workers))
    h = sup.workers[name]
    h.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        h.started_at, h.ready = 1000.0, False
        h.last_heartbeat = 1059.0  # it beats
        sup._check_one(h, 1059.5)
        assert h.proc is not None and h.proc.poll() is None and not lost
        h.last_heartbeat = 1060.5
        sup._check_one(h, 1061.0)  # 61 s after its start, still not ready
        assert h.proc is None and lost and lost[0][0] == name, lost
        assert "workers.ready_timeout" in lost[0][1] and "60 s" in lost[0][1]
        ready = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        h.proc, h.ready, h.started_at, h.last_heartbeat = ready, True, 1000.0, 5000.0
        sup._check_one(h, 5001.0)  # ready long after ready_timeout: only its heartbeat counts
        assert h.proc is ready and len(lost) == 1
    finally:
        for w in sup.workers.values():
            if w.proc is not None:
                w.proc.kill()
                w.proc.wait()
