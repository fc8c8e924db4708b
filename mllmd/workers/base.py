"""What every worker shares: argument parsing, the link to main, heartbeats, and clean exit."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from mllmd import heap, logfmt
from mllmd.messages import Heartbeat, WorkerFatal, WorkerReady, encode
from mllmd.workers import ipc


class WorkerContext:
    """A worker's sockets to main, its settings and its heartbeat thread."""

    def __init__(self, name: str, ipc_dir: str, settings: dict[str, Any]) -> None:
        self.name = name
        self.ipc_dir = ipc_dir
        self.settings = settings
        self.ctx = zmq.Context()
        self.to_main = ipc.push(self.ctx, ipc_dir, ipc.MAIN)
        self._main_lock = threading.Lock()
        self._stop = threading.Event()
        self.count_requests: Callable[[], int] | None = None  # set by a worker that keeps per-request state

    def send_main(self, msg: Any) -> None:
        """Send one of mllmd.messages' structs to main (thread-safe: the heartbeat thread sends too)."""
        data = encode(msg)
        with self._main_lock:
            self.to_main.send(data)

    def start_heartbeats(self, interval: float) -> None:
        """Tell main we are alive every `interval` seconds (a stopped process sends nothing), with how
        many requests we hold state for when `self.count_requests` is set."""

        parent = os.getppid()

        def beat() -> None:
            while not self._stop.wait(interval):
                if os.getppid() != parent:  # main died (kill -9): nobody will stop us, so stop now
                    logging.getLogger(self.name).error("the main process (pid %d) is gone; exiting", parent)
                    self.stop()
                    return
                count = self.count_requests
                self.send_main(Heartbeat(self.name, os.getpid(), time.time(), count() if count else None))

        threading.Thread(target=beat, name=f"{self.name}-heartbeat", daemon=True).start()

    def ready(self, **info: Any) -> None:
        """Report the worker loaded; what it holds from now on is frozen out of full collections
        (mllmd.heap: a full collection of a loaded worker stalled it for hundreds of ms)."""
        frozen = heap.freeze_long_lived()
        logging.getLogger(self.name).debug("%d objects frozen out of the garbage collector", frozen)
        self.send_main(WorkerReady(self.name, os.getpid(), **info))

    def fatal(self, message: str) -> None:
        self.send_main(WorkerFatal(self.name, os.getpid(), message))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()


def worker_main(name: str, body: Callable[[WorkerContext], None]) -> None:
    """Entry point of a worker process: `python -m mllmd.workers.<name>_worker --ipc-dir D --settings F`."""
    ap = argparse.ArgumentParser(prog=f"mllmd-{name}")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--settings", required=True, help="JSON file written by the supervisor")
    args = ap.parse_args()
    with open(args.settings) as f:
        settings = json.load(f)
    logfmt.configure(settings.get("log_level", "INFO"), settings.get("log_format", "text"), f"mllmd-{name}")
    wctx = WorkerContext(name, args.ipc_dir, settings)
    signal.signal(signal.SIGTERM, lambda *_: wctx.stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    wctx.start_heartbeats(float(settings.get("heartbeat_interval", 1.0)))
    try:
        body(wctx)
    except Exception as e:  # report, then exit non-zero so the supervisor restarts us
        logging.getLogger(name).exception("worker failed")
        wctx.fatal(f"{type(e).__name__}: {e}")
        time.sleep(0.2)
        raise SystemExit(1) from e
