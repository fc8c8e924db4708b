"""The daemon's main process: supervisor, HTTP (TCP + Unix socket), request routing, systemd notify.

The main process never imports torch: workers do the ML work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from mllmd.daemon.config import DaemonConfig
from mllmd.daemon.request_manager import RequestManager
from mllmd.daemon.supervisor import Supervisor, WorkerPolicy
from mllmd.openai.errors import APIError, service_unavailable
from mllmd.workers import ipc

logger = logging.getLogger("mllmd")


class Notifier:
    """sd_notify (a no-op outside systemd)."""

    def __init__(self) -> None:
        import sdnotify

        self._n = sdnotify.SystemdNotifier() if os.environ.get("NOTIFY_SOCKET") else None

    def send(self, line: str) -> None:
        if self._n is not None:
            self._n.notify(line)


def _ipc_dir() -> Path:
    base = os.environ.get("RUNTIME_DIRECTORY")
    if base:
        d = Path(base.split(":")[0]) / f"ipc-{os.getpid()}"
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return d
    return Path(tempfile.mkdtemp(prefix="mllmd-"))


def _unix_listener(path: str) -> socket.socket:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise RuntimeError(f"server.unix_socket: {path} exists and is not a socket")
        p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started_at = int(time.time())
        self.ipc_dir = _ipc_dir()
        self.zctx = zmq.asyncio.Context()
        self.inbox = ipc.pull(self.zctx, self.ipc_dir, ipc.MAIN)  # type: ignore[arg-type]
        self.rm = RequestManager(self.zctx, str(self.ipc_dir))
        self.notifier = Notifier()
        self.supervisor: Supervisor | None = None
        self.served_model_name: str | None = None
        self.model_path: str | None = None
        self.engine_stats: dict[str, Any] = {}
        self.draining = False
        self._stop = asyncio.Event()
        self._announced_ready = False

    # ---- state -------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.supervisor is None:
            return "idle"
        if self.supervisor.degraded_reason:
            return "degraded"
        return "ready" if self.supervisor.all_ready else "loading"

    def not_ready_reason(self) -> str | None:
        state = self.state
        if state == "ready":
            return None
        if state == "idle":
            return "no model is loaded"
        if state == "degraded":
            return f"degraded: {self.supervisor.degraded_reason}"  # type: ignore[union-attr]
        if state == "draining":
            return "the server is shutting down"
        return "the model is loading or a worker is restarting"

    def admit_or_raise(self, n: int) -> None:
        """Back-pressure: refuse with 503 + Retry-After when the waiting queue would overflow."""
        limit = self.config.server.max_queued_requests + self.config.engine.max_running_requests
        if self.rm.num_in_flight + n > limit:
            raise service_unavailable(
                f"the server is at capacity ({self.rm.num_in_flight} requests in flight, "
                f"max_queued_requests={self.config.server.max_queued_requests}); retry later",
                retry_after=1,
            )

    # ---- model -------------------------------------------------------------------------------
    def start_model(self, path: str) -> None:
        engine = self.config.engine_config(path)
        self.model_path = engine.model_path
        self.served_model_name = self.config.served_model_name(engine.model_path)
        w = self.config.workers
        settings = {
            "engine": dataclasses.asdict(engine),
            "tokenizer_path": engine.tokenizer_path or engine.model_path,
            "heartbeat_interval": w.heartbeat_interval,
            "log_level": self.config.logging.level,
        }
        policy = WorkerPolicy(
            heartbeat_interval=w.heartbeat_interval, heartbeat_timeout=w.heartbeat_timeout,
            backoff_initial=w.restart_backoff_initial, backoff_max=w.restart_backoff_max,
            max_restarts=w.max_restarts, restart_window=w.restart_window, ready_timeout=w.ready_timeout,
        )
        self.supervisor = Supervisor(self.ipc_dir, settings, policy, self._worker_lost)
        self.supervisor.start_all()
        self.notifier.send(f"STATUS=loading {self.served_model_name}")

    def _worker_lost(self, name: str, reason: str) -> None:
        self.rm.fail_all(f"request failed: {reason}; the worker is being restarted")
        self.notifier.send(f"STATUS={self.state}: {reason}")

    # ---- loops -------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.inbox.recv_pyobj()
            kind = msg.get("type")
            if kind in ("heartbeat", "ready", "fatal"):
                if self.supervisor is not None:
                    self.supervisor.on_message(msg)
            elif kind == "stats":
                self.engine_stats = msg
            elif kind in ("outputs", "error"):
                for rid in self.rm.deliver(msg):
                    await self.rm.to_scheduler.send_pyobj({"type": "abort", "rid": rid})

    async def _supervise_loop(self) -> None:
        last_state = None
        while True:
            if self.supervisor is not None and not self.draining:
                self.supervisor.check()
            state = self.state
            if state != last_state:
                logger.info("state: %s", state)
                if state == "ready" and not self._announced_ready:
                    self.notifier.send("READY=1")
                    self._announced_ready = True
                self.notifier.send(f"STATUS={state}" + (f" ({self.served_model_name})" if self.served_model_name else ""))
                last_state = state
            await asyncio.sleep(0.1)

    async def _watchdog_loop(self) -> None:
        usec = os.environ.get("WATCHDOG_USEC")
        if not usec or not usec.isdigit():
            return
        interval = int(usec) / 2e6
        while True:
            self.notifier.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    # ---- serve -------------------------------------------------------------------------------
    async def serve(self) -> int:
        import uvicorn

        from mllmd.daemon.http_app import build_app

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        srv = self.config.server
        sockets = [_tcp_listener(srv.host, srv.port)]
        if srv.unix_socket:
            sockets.append(_unix_listener(srv.unix_socket))
        if self.config.model.path:
            self.start_model(self.config.model.path)
        else:
            self.notifier.send("READY=1")
            self._announced_ready = True
        app = build_app(self)
        uconfig = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        server = uvicorn.Server(uconfig)
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._supervise_loop()),
            asyncio.create_task(self._watchdog_loop()),
            asyncio.create_task(server.serve(sockets=sockets)),
        ]
        logger.info("listening on http://%s:%d%s", srv.host, srv.port, f" and unix:{srv.unix_socket}" if srv.unix_socket else "")
        await self._stop.wait()
        await self._drain()
        server.should_exit = True
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        if self.supervisor is not None:
            self.supervisor.stop_all()
        if srv.unix_socket:
            Path(srv.unix_socket).unlink(missing_ok=True)
        self.zctx.destroy(linger=0)
        return 0

    async def _drain(self) -> None:
        """Stop accepting, let in-flight requests finish up to shutdown_timeout, abort the rest."""
        self.notifier.send("STOPPING=1")
        self.draining = True
        deadline = time.monotonic() + self.config.server.shutdown_timeout
        while self.rm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.rm.reqs):
            await self.rm.abort(rid)
        self.rm.fail_all("the server is shutting down", status=503)

    def _reload(self) -> None:
        self.notifier.send("RELOADING=1")
        logger.info("SIGHUP: configuration reload is handled by the control plane (not yet); nothing changed")
        self.notifier.send("READY=1")


def _setup_logging(config: DaemonConfig) -> None:
    logging.basicConfig(level=config.logging.level, format="%(asctime)s mllmd[%(process)d] %(levelname)s %(name)s: %(message)s")


def run(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM; returns the exit status."""
    _setup_logging(config)
    try:
        return asyncio.run(Daemon(config).serve())
    except (OSError, RuntimeError, APIError) as e:
        logger.error("%s", e)
        return 1
