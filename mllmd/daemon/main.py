"""The daemon's main process: HTTP (TCP + Unix socket), model lifecycle, metrics, systemd notify.

Each loaded model lives in a ModelSlot (its workers and requests). A load while serving is a hot
swap: the new slot loads beside the active one and takes over new requests once ready; the old one
finishes what it holds, then stops. The main process never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from mllmd import __version__, heap, knobs, logfmt
from mllmd.config import ConfigError, EngineConfig
from mllmd.daemon.config import DaemonConfig, load_config
from mllmd.daemon.http_common import BodyBudget
from mllmd.daemon.http_server import ConnectionGuard, connection_caps, protocol_class, raise_nofile_limit
from mllmd.daemon.metrics import Metrics
from mllmd.daemon.model_slot import ModelSlot
from mllmd.daemon.models import (
    ModelError,
    check_loadable,
    check_ml_stack,
    check_tokenizer,
    inspect_model,
    resolve_in_models_dirs,
)
from mllmd.daemon.ratelimit import RateLimitedLog, RateLimitFilter
from mllmd.daemon.sd_notify import Notifier, watchdog_usec
from mllmd.daemon.state import STATE_FILE, Record, StateError, read_record, write_record
from mllmd.daemon.state import probe as probe_state
from mllmd.daemon.supervisor import WorkerPolicy
from mllmd.messages import ControlResult, EngineStats, FlushCache, RequestFailed, TextOutputs
from mllmd.openai.errors import APIError, bad_request, service_unavailable
from mllmd.openai.limits import Limits
from mllmd.telemetry.collector import TelemetryCollector
from mllmd.workers import ipc

logger = logging.getLogger("mllmd")
_errors = RateLimitedLog(logger)
# What an admin load may override: the engine's settings, except the model folder itself.
_OVERRIDABLE = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model_path"}
# Keys a reload (SIGHUP, POST /admin/reload) applies at once; the others need a restart or a model load.
LIVE_KEYS = (
    "server.api_key", "server.api_key_file", "server.admin_api_key", "server.max_queued_requests",
    "server.max_request_bytes", "server.shutdown_timeout", "server.reasoning_parser", "server.tool_call_parser",
    "server.metrics_require_key", "model.models_dir", "logging.level",
    "server.max_json_depth", "server.max_stop_length", "server.body_timeout", "server.send_timeout",
    "server.default_max_tokens", "server.max_tokens_cap", "server.sse_keepalive_interval",
)
# Keys read when a model loads (the engine's, its workers' and the image loader's): a reload keeps the
# new values for the next `mllmctl load-model`; the model serving now goes on with those it loaded with.
LOAD_SECTIONS = ("scheduler", "cache", "runtime", "ipc", "workers")
LOAD_KEYS = (
    "model.tokenizer_path", "model.dtype", "model.context_length", "model.chat_template", "model.quantization",
    "server.media_dirs", "server.allow_remote_images", "server.remote_image_timeout", "server.max_image_bytes",
    "server.max_image_pixels", "server.max_image_decode_pixels", "server.max_images_per_request",
)


def applies_at_load(key: str) -> bool:
    return key in LOAD_KEYS or key.split(".", 1)[0] in LOAD_SECTIONS


def _state_status(states: Any) -> dict[str, Any]:
    held = states.total - states.free - states.snapshots
    return {"total_slots": states.total, "free_slots": states.free, "request_slots": held,
            "snapshot_slots": states.snapshots, "bytes_per_slot": states.bytes_per_slot,
            "usage_ratio": round(held / states.total, 4) if states.total else 0.0}


def _socket_answers(path: str) -> bool:
    """Something accepts connections on the Unix socket `path` (a live daemon, not a stale file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False  # stale: nobody listens (a daemon that was killed)
    except OSError:
        return True  # EAGAIN (a full backlog), EACCES, a timeout: someone is there, or we cannot tell
    else:
        return True
    finally:
        probe.close()


def _unix_listener(path: str, backlog: int = 512) -> tuple[socket.socket, tuple[int, int]]:
    """Bind the Unix socket; a stale socket file is replaced, a live one (another daemon answers on it)
    is an error. Returns the socket and the (device, inode) of its file, so that only our own file is
    removed at exit."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise RuntimeError(f"server.unix_socket: {path} exists and is not a socket")
        if _socket_answers(path):
            raise RuntimeError(f"server.unix_socket: another daemon is listening on {path}; stop it first "
                               "(or give this one another server.unix_socket)")
        p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    sock.listen(backlog)
    sock.setblocking(False)
    st = os.stat(path)
    return sock, (st.st_dev, st.st_ino)


def _remove_own_socket(path: str, ident: tuple[int, int] | None) -> None:
    """Unlink the Unix socket file if it is still the one we bound (another daemon may have replaced it)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if ident is not None and (st.st_dev, st.st_ino) == ident:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _tcp_listener(host: str, port: int, backlog: int = 512) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP (not 0): asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP,
    # and accepted sockets copy the listener's proto. With Nagle on, a small SSE write waits for the ACK of
    # the previous one: on a reused (keep-alive) connection that adds a delayed-ACK time (~40 ms) to TTFT.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def state_dir() -> Path:
    return knobs.state_dir()


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started_at = int(time.time())
        self.started_mono = time.monotonic()
        self.zctx = zmq.asyncio.Context()
        self.notifier = Notifier()
        self.metrics = Metrics(workers=ipc.WORKERS)
        self.bodies = BodyBudget(config.server.max_request_bytes)  # request bodies arriving, in all
        self.telemetry = TelemetryCollector(config.telemetry, on_snapshot=self.metrics.set_telemetry)
        self.active: ModelSlot | None = None
        self.pending: ModelSlot | None = None
        self.load_error: str | None = None
        self.draining = False
        self.stopping = False
        self._stop = asyncio.Event()
        self._announced_ready = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._controls: dict[str, asyncio.Future[ControlResult]] = {}
        self.retiring: set[ModelSlot] = set()  # slots finishing their requests before they stop
        self.connections: ConnectionGuard | None = None  # set by serve()

    # ---- state -------------------------------------------------------------------------------
    @property
    def served_model_name(self) -> str | None:
        return self.active.served_name if self.active is not None else None

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the active model answers to (its primary name first); () without one."""
        if self.active is None:
            return ()
        return self.active.aliases

    @property
    def state(self) -> str:
        if self.draining or self.stopping:
            return "draining"
        if self.active is None:
            return "loading" if self.pending is not None else "idle"
        if self.active.supervisor.degraded_reason:
            return "degraded"
        return "ready" if self.active.ready else "loading"

    @property
    def limits(self) -> Limits:
        """The request bounds that are configurable (server.max_json_depth, server.max_stop_length)."""
        srv = self.config.server
        return Limits(srv.max_json_depth, srv.max_stop_length)

    def slots(self) -> list[ModelSlot]:
        """Every slot that may hold requests: the active one, a loading one, retiring ones."""
        return [s for s in (self.active, self.pending, *self.retiring) if s is not None]

    def not_ready_reason(self, detail: bool = False) -> str | None:
        """Why requests are refused now; None when ready. Without `detail` (what API clients and an
        unauthenticated /health see): no paths, no load errors, no worker errors (those are in
        /admin/status)."""
        state = self.state
        if state == "ready":
            return None
        if state == "idle":
            if not self.load_error:
                return "no model is loaded"
            return f"no model is loaded (last load failed: {self.load_error})" if detail else (
                "no model is loaded (the last load failed; see mllmctl status)")
        if state == "degraded":
            sup = self.active.supervisor  # type: ignore[union-attr]
            if detail:
                return f"degraded: {sup.degraded_reason}"
            return f"degraded: the {sup.degraded_worker} worker keeps failing (see mllmctl status)"
        if state == "draining":
            return "the server is draining: it accepts no new requests"
        return "the model is loading or a worker is restarting"

    def serving_slot(self, n: int, param: str = "n") -> ModelSlot:
        """The slot new requests go to, for `n` engine requests (choices); 503 with Retry-After when not
        ready or at capacity (`param`: the field a never-admissible `n` is blamed on)."""
        reason = self.not_ready_reason()
        if reason is not None or self.active is None:
            raise service_unavailable(reason or "no model is loaded")
        slot = self.active
        stats = slot.engine_stats
        running = stats.running if stats is not None else 0
        # what can run at once: max_running_requests, and for a hybrid model its recurrent-state slots
        runnable, what_runs = slot.engine.max_running_requests, "scheduler.max_running_requests"
        if stats is not None and stats.states is not None and 0 < stats.states.total < runnable:
            runnable, what_runs = stats.states.total, "the recurrent-state slots (cache.state_slots)"
        limit = self.config.server.max_queued_requests + runnable
        if n > limit:  # could never be admitted, however long the client waits: not a retryable 503
            what = f"n={n}" if param == "n" else f"{n} choices (prompts x n)"
            raise bad_request(
                f"{what} exceeds what this server can hold at once ({limit} requests: "
                f"server.max_queued_requests + {what_runs})",
                param,
            )
        if slot.rm.num_in_flight + n > limit:
            raise service_unavailable(
                f"the server is at capacity ({slot.rm.num_in_flight} requests in flight, {running} running; "
                f"max_queued_requests={self.config.server.max_queued_requests}); retry later",
                retry_after=1,
            )
        return slot

    def _retire(self, slot: ModelSlot, drain: bool) -> None:
        """Stop a slot in the background (after its requests finish when `drain`)."""
        self.retiring.add(slot)

        async def run() -> None:
            try:
                if drain:
                    await slot.drain_and_stop(self.config.server.shutdown_timeout)
                else:
                    await slot.stop()
            finally:
                self.retiring.discard(slot)

        self._spawn(run())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- model lifecycle ---------------------------------------------------------------------
    def _policy(self) -> WorkerPolicy:
        w = self.config.workers
        return WorkerPolicy(
            heartbeat_interval=w.heartbeat_interval, heartbeat_timeout=w.heartbeat_timeout,
            backoff_initial=w.restart_backoff_initial, backoff_max=w.restart_backoff_max,
            max_restarts=w.max_restarts, restart_window=w.restart_window, ready_timeout=w.ready_timeout,
        )

    def _check_overrides(self, overrides: Any) -> dict[str, Any]:
        """Model overrides from the admin API or the state record: engine settings only, never the model
        path, and a tokenizer_path that resolves inside model.models_dir (returned resolved)."""
        if not isinstance(overrides, dict):
            raise ModelError("'overrides' must be an object of model settings")
        out: dict[str, Any] = {}
        for key, value in overrides.items():
            if key == "model_path":
                raise ModelError("overrides.model_path is not allowed: name the model folder in 'model' "
                                 "(it must be inside model.models_dir)")
            if key not in _OVERRIDABLE:
                raise ModelError(f"unknown model override {key[:100]!r} (known: {', '.join(sorted(_OVERRIDABLE))})")
            if key == "tokenizer_path" and value is not None:
                value = str(resolve_in_models_dirs(value, self.config.model.models_dir, "overrides.tokenizer_path"))
            out[key] = value
        return out

    def _engine_for(self, path: str, overrides: dict[str, Any]) -> EngineConfig:
        engine = self.config.engine_config(path)
        if overrides:
            try:
                engine = engine.replace(**overrides)
            except TypeError as e:
                raise ModelError(f"unknown model override: {e}") from None
            except ConfigError as e:
                raise ModelError(f"bad model override {e}") from None
        return engine

    def begin_load(self, path: str, overrides: dict[str, Any], served_name: str | None = None,
                   strict_record: bool = True, fallback: str | None = None) -> str:
        """Validate, then start loading `path` in a new slot (a hot swap if a model is active).

        `strict_record`: the load fails if it cannot be recorded in the state folder (admin loads; at
        boot a failure to record is only logged). `fallback`: a model to load instead if this one fails
        (a recorded model at boot falls back to model.path)."""
        if self.pending is not None:
            raise ModelError(f"a load is already in progress ({self.pending.engine.model_path})")
        check_ml_stack()
        facts = inspect_model(path, self.config.model.models_dir)
        engine = self._engine_for(path, overrides)
        check_loadable(facts, max_running_requests=engine.max_running_requests, context=engine.context_length,
                       state_slots=engine.state_slots)
        try:
            self.config.check_quantization(facts.quantization)
        except ConfigError as e:
            raise ModelError(str(e)) from None
        check_tokenizer(engine.tokenizer_path or path, self.config.model.models_dir)
        name = served_name or self.config.served_model_name(path) or facts.name
        slot = ModelSlot(engine, facts, name, self._policy(), self.config.logging.level, self.zctx,
                         self._on_slot_message, self._on_worker_lost, self.config.model.chat_template,
                         self._media_settings(), self.config.logging.format)
        slot.rm.on_abort = functools.partial(self.metrics.on_request_failed, "aborted", model_name=name)
        names = self.config.served_model_names(path)
        if names and names[0] == name:
            slot.aliases = names
        slot.overrides = overrides  # type: ignore[attr-defined]
        slot.strict_record = strict_record  # type: ignore[attr-defined]
        slot.fallback = fallback  # type: ignore[attr-defined]
        self.pending, self.load_error, self.draining = slot, None, False
        slot.start()
        self.notifier.send(f"STATUS=loading {name}")
        logger.info("loading %s from %s", name, path)
        return f"loading {name} from {path}" + (" (hot swap: the current model serves until it is ready)"
                                                   if self.active is not None else "")

    def _media_settings(self) -> dict[str, Any]:
        """The image limits and the tensor transport, for the tokenizer worker of the next load."""
        srv = self.config.server
        keys = ("media_dirs", "allow_remote_images", "remote_image_timeout", "max_image_bytes", "max_image_pixels",
                "max_image_decode_pixels", "max_images_per_request")
        return {"server": {k: getattr(srv, k) for k in keys}, "ipc": dataclasses.asdict(self.config.ipc)}

    async def load_model(self, ref: str, overrides: Any) -> str:
        """Admin load: `ref` and every path among the overrides must resolve inside model.models_dir, and
        the state folder must be writable (else the load is refused: a restart would not repeat it)."""
        path = resolve_in_models_dirs(ref, self.config.model.models_dir)
        checked = self._check_overrides(overrides)
        try:
            probe_state(state_dir())
        except StateError as e:
            raise APIError(500, f"{e}; the load was refused, since a restart would not load this model",
                           "server_error", None, "state_not_writable") from None
        return self.begin_load(str(path), checked)

    async def unload_model(self) -> str:
        try:
            self._record_active(None, {}, strict=True)  # first: a refused unload changes nothing
        except StateError as e:
            raise APIError(500, f"{e}; nothing was unloaded, since a restart would load the model again",
                           "server_error", None, "state_not_writable") from None
        if self.pending is not None:
            slot, self.pending = self.pending, None
            await slot.stop()
        if self.active is None:
            return "no model was loaded"
        slot, self.active = self.active, None
        self.metrics.clear_model()
        self._retire(slot, drain=True)
        return f"unloading {slot.served_name}: requests in flight finish first"

    async def start_drain(self) -> str:
        self.draining = True
        n = sum(s.rm.num_in_flight for s in self.slots())
        return f"draining: no new requests are accepted; {n} in flight will finish (a load-model ends the drain)"

    async def flush_cache(self) -> str:
        if self.active is None or not self.active.ready:
            raise APIError(409, "no model is ready", "invalid_request_error", None, "no_model")
        cid = os.urandom(6).hex()
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        await self.active.rm.send_control(FlushCache(cid))
        try:
            result = await asyncio.wait_for(fut, 10.0)
        except asyncio.TimeoutError:
            raise APIError(504, "the scheduler did not answer the flush in 10 s", "server_error") from None
        finally:
            self._controls.pop(cid, None)
        return f"flushed the prefix cache: {result.freed_tokens} cached tokens freed (entries in use kept)"

    def _record_active(self, path: str | None, overrides: dict[str, Any], strict: bool) -> None:
        """Remember the active model so a restart loads it again (nothing is written when the record
        already says so). A failure raises StateError when `strict`, else it is logged."""
        d = state_dir()
        record = Record(path, overrides, self.config.model.path)
        try:
            if read_record(d)[0] != record:
                write_record(d, record)
        except StateError as e:
            if strict:
                raise
            logger.warning("%s (a restart may load another model)", e)

    def _config_model(self) -> str | None:
        return self.config.engine_config().model_path if self.config.model.path else None

    def _boot_model(self) -> tuple[str | None, dict[str, Any], bool]:
        """The model to load at start: (path, overrides, from the record). The recorded one if it can
        be used, else model.path: whatever the state file holds, the reason it is not used is logged."""
        f = state_dir() / STATE_FILE
        rec, why = read_record(state_dir())
        if rec is None:
            if why:
                logger.warning("ignoring %s: %s; loading model.path", f, why)
            return self._config_model(), {}, False
        if rec.boot_default != self.config.model.path:
            logger.info("model.path changed since %s was written; loading model.path", f)
            return self._config_model(), {}, False
        if rec.path is None:
            return None, {}, True  # unloaded on purpose: boot idle
        try:
            configured = self._config_model()
            if configured is not None and Path(rec.path).resolve() == Path(configured).resolve():
                path = str(Path(rec.path).resolve())
            else:
                path = str(resolve_in_models_dirs(rec.path, self.config.model.models_dir))
            return path, self._check_overrides(rec.overrides), True
        except ModelError as e:
            logger.warning("the model recorded in %s cannot be loaded (%s); loading model.path", f, e)
            return self._config_model(), {}, False

    def _load_at_boot(self, path: str, overrides: dict[str, Any], fallback: str | None) -> None:
        """Start the boot load; if it is refused at once and there is a fallback (model.path instead of
        a recorded model), load that. Never raises: the daemon serves /health and the admin API anyway."""
        try:
            self.begin_load(path, overrides, self.config.served_model_name(path), strict_record=False,
                            fallback=fallback)
            return
        except Exception as e:  # ModelError, or anything a corrupted record could lead to
            self.load_error = f"cannot load {path}: {e}"
            logger.error("%s", self.load_error)
        if fallback:
            logger.warning("loading model.path (%s) instead of the recorded model", fallback)
            self._load_at_boot(fallback, {}, None)

    def _on_worker_lost(self, slot: ModelSlot, name: str, reason: str) -> None:
        if slot is self.pending:
            return  # handled by the load watcher
        giving_up = slot.supervisor.degraded_worker == name
        message = f"request failed: {reason}; " + ("the server gave up restarting it" if giving_up else
                                                    "the worker is being restarted")  # fmt: skip
        if name == ipc.TOKENIZER:  # only requests it may still hold: the others never need it again
            rids = slot.rm.fail_unstarted(message)
        else:
            rids = list(slot.rm.reqs)
            slot.rm.fail_all(message)
        for rid in rids:
            self.metrics.forget(rid)
        self.metrics.on_request_failed("error", len(rids), model_name=slot.served_name)
        if not giving_up:
            self.metrics.on_worker_restart(name)
        if name != ipc.SCHEDULER and rids:  # the engine still runs them: nobody would read their output
            self._spawn(self._abort_in_scheduler(slot, rids))
        self.notifier.send(f"STATUS={self.state}: {reason}")

    async def _abort_in_scheduler(self, slot: ModelSlot, rids: list[str]) -> None:
        for rid in rids:
            await slot.rm.send_abort(rid)

    def _on_slot_message(self, slot: ModelSlot, msg: Any) -> None:
        if isinstance(msg, EngineStats):
            if slot is self.active:
                self.metrics.observe_engine_stats(msg)
            self.metrics.observe_timings(msg.timings, slot.served_name)
        elif isinstance(msg, TextOutputs):
            for item in msg.items:
                st = slot.rm.reqs.get(item.rid)
                if st is not None:
                    self.metrics.on_output(item.rid, item, st.created, model_name=slot.served_name)
                elif item.finished:  # its handler gave it up (client gone, admin abort): its timeline goes
                    self.metrics.forget(item.rid)
        elif isinstance(msg, RequestFailed):
            live = [r for r in slot.rm.groups.get(msg.rid, [msg.rid]) if r in slot.rm.reqs]
            for r in live:
                self.metrics.forget(r)
            self.metrics.on_request_failed("rejected" if msg.code == "invalid_request" else "error", len(live),
                                           model_name=slot.served_name)
        elif isinstance(msg, ControlResult):
            fut = self._controls.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _watch_pending(self) -> None:
        slot = self.pending
        if slot is None:
            return
        sup = slot.supervisor
        failed = next((h for h in sup.workers.values() if h.restart_times), None)  # lost once at least
        if slot.ready:
            try:
                self._record_active(slot.engine.model_path, getattr(slot, "overrides", {}),
                                    strict=getattr(slot, "strict_record", True))
            except StateError as e:
                self.load_error = (f"loading {slot.engine.model_path} failed: {e}; the model was not switched "
                                   "to, so that a restart serves what runs now")
                logger.error("%s", self.load_error)
                self.pending = None
                self._retire(slot, drain=False)
                return
            old, self.active, self.pending = self.active, slot, None
            d = slot.describe()
            self.metrics.set_model(slot.served_name, d["architecture"], d["dtype"], d["quantization"] or "none")
            self.metrics.observe_model_load(slot.load_seconds or 0.0, slot.served_name)
            logger.info("model %s ready in %.1f s", slot.served_name, slot.load_seconds or 0.0)
            if old is not None:
                self._retire(old, drain=True)
            heap.freeze_long_lived()  # the new slot's objects; the last swap's garbage collected first
        elif failed is not None or time.monotonic() - slot.load_started > self.config.workers.ready_timeout:
            why = (failed.last_error or "the worker exited") if failed is not None else "timed out"
            self.load_error = f"loading {slot.engine.model_path} failed: {why}"
            logger.error("%s", self.load_error)
            self.pending = None
            self._retire(slot, drain=False)
            fallback = getattr(slot, "fallback", None)
            if fallback:
                logger.warning("the recorded model did not load; loading model.path (%s) instead", fallback)
                self._load_at_boot(fallback, {}, None)

    # ---- loops -------------------------------------------------------------------------------
    async def _supervise_loop(self) -> None:
        """Watch the workers and the state, every 0.1 s, for as long as the daemon runs: an exception in
        one round (the machine out of file descriptors, a bug) is logged, rate-limited, and the next
        round tries again; the loop itself never ends."""
        last_state: list[str | None] = [None]
        while True:
            try:
                self._supervise_once(last_state)
            except Exception:
                _errors.exception("supervise", "the supervisor's round failed; retrying")
            await asyncio.sleep(0.1)

    def _supervise_once(self, last_state: list[str | None]) -> None:
        if not self.stopping:
            if self.pending is not None:
                self.pending.supervisor.check()
                self._watch_pending()
            if self.active is not None:
                self.active.supervisor.check()
        state = self.state
        if state != last_state[0]:
            logger.info("state: %s", state)
            self.metrics.set_up(state == "ready")
            if state in ("ready", "idle") and not self._announced_ready and self.pending is None:
                self.notifier.send("READY=1")
                self._announced_ready = True
            self.notifier.send(f"STATUS={state}" + (f" ({self.served_model_name})" if self.served_model_name else ""))
            last_state[0] = state

    async def _watchdog_loop(self) -> None:
        usec = watchdog_usec()
        if usec is None:
            return
        interval = usec / 2e6
        while True:
            self.notifier.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    # ---- status and reload -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        slot = self.active
        stats = slot.engine_stats if slot is not None else None
        kv = stats.kv if stats is not None else None
        total = kv.total if kv is not None else 0
        used = total - kv.free - kv.evictable if kv is not None and total else 0
        pend = self.pending
        snap = self.telemetry.latest().to_dict()
        in_flight = sum(s.rm.num_in_flight for s in self.slots())
        return {
            "state": self.state,
            "reason": self.not_ready_reason(detail=True),
            "model": slot.describe() if slot is not None else None,
            "load": {
                "in_progress": pend is not None,
                "path": pend.engine.model_path if pend is not None else None,
                "progress": round(pend.progress, 3) if pend is not None else None,
                "stage": ("loading weights" if pend is not None and pend.progress < 1 else None),
                "error": self.load_error,
            },
            "version": __version__,
            "uptime_seconds": round(time.monotonic() - self.started_mono, 3),
            "workers": slot.supervisor.status() if slot is not None else [],
            "requests": {"running": stats.running if stats is not None else 0,
                         "waiting": stats.waiting if stats is not None else 0,
                         # every model's, also one being swapped out that finishes its requests
                         "in_flight": in_flight,
                         "retiring": sum(s.rm.num_in_flight for s in self.retiring),
                         # what main keeps per request (all 0 when idle: nothing may accumulate)
                         "tracked": {"requests": in_flight,
                                     "groups": sum(s.rm.num_groups for s in self.slots()),
                                     "client_ids": sum(len(s.rm.aliases) for s in self.slots()),
                                     "metrics": self.metrics.num_tracked}},
            "kv_cache": {"total_tokens": total, "free_tokens": kv.free, "cached_tokens": kv.cached,
                         "usage_ratio": round(used / total, 4)} if kv is not None and total else {},
            # hybrid models (Qwen3.5): per-request recurrent states beside the KV cache
            "state_cache": _state_status(stats.states) if stats is not None and stats.states is not None else None,
            "memory": {"used_bytes": snap.get("memory_used_bytes"), "total_bytes": snap.get("memory_total_bytes"),
                       "gpu_used_bytes": snap.get("gpu_memory_used_bytes"),
                       "gpu_total_bytes": snap.get("gpu_memory_total_bytes")},
            "telemetry_sources": snap.get("sources"),
            "connections": {**self.connections.stats(), "body_bytes_arriving": self.bodies.used,
                            "body_bytes_limit": self.bodies.limit} if self.connections is not None else None,
            "config": self.config.redacted(),
        }

    def reload_config(self) -> dict[str, Any]:
        """Re-read the YAML (+ environment, + the original command line, + the API key file): the keys
        in LIVE_KEYS apply now, those read at a model load (applies_at_load) from the next load, the
        others (listening sockets, connection limits, telemetry, the boot model) need a restart. A
        configuration that is invalid, alone or with what is running, changes nothing (400)."""
        cli = {k: self.config.get(k) for k, src in self.config.sources.items() if str(src).startswith("command line")}

        def invalid(e: Exception) -> APIError:
            return APIError(400, f"the configuration is invalid, nothing changed: {e}", "invalid_request_error",
                            None, "bad_config")

        try:
            new = load_config(self.config.config_file, cli)
        except ConfigError as e:
            raise invalid(e) from None
        changed = {k for k in new.sources.keys() | self.config.sources.keys() if new.get(k) != self.config.get(k)}
        if new.api_keys != self.config.api_keys and "server.api_key" not in changed:  # the key file's lines
            changed.add("server.api_key_file")
        live = sorted(k for k in changed if k in LIVE_KEYS)
        at_load = sorted(k for k in changed if k not in LIVE_KEYS and applies_at_load(k))
        restart = sorted(changed - set(live) - set(at_load))
        if live or at_load:
            try:
                self.config = self.config.with_values({k: new.get(k) for k in live + at_load}, source="reload")
            except ConfigError as e:  # e.g. an API key removed while the LAN still needs one
                raise invalid(e) from None
            srv = self.config.server
            self.bodies.resize(srv.max_request_bytes)
            if self.connections is not None:
                self.connections.body_timeout = srv.body_timeout
                self.connections.send_timeout = srv.send_timeout
            if "logging.level" in live:  # the workers take it at the next model load
                logging.getLogger().setLevel(self.config.logging.level)
        logger.info("reload: applied %s; from the next model load %s; needs a restart: %s", live or "nothing",
                    at_load or "nothing", restart or "nothing")
        return {"message": f"applied {len(live)} change(s) now, {len(at_load)} from the next model load; "
                           f"{len(restart)} need a restart",
                "applied": live, "next_load": at_load, "needs_restart": restart}

    def _on_sighup(self) -> None:
        if self._announced_ready:  # still starting: the READY=1 to come is the only one systemd waits for
            self.notifier.reloading()
        try:
            self.reload_config()
        except APIError as e:
            logger.error("%s", e.message)
        except Exception:  # never leave systemd waiting in "reloading"
            logger.exception("reload failed")
        finally:
            if self._announced_ready:  # before the first READY=1 (still loading), that one comes when ready
                self.notifier.send("READY=1")

    # ---- serve -------------------------------------------------------------------------------
    async def serve(self) -> int:
        import uvicorn

        from mllmd.daemon.http_app import build_app

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        loop.set_exception_handler(_loop_exception)
        logging.getLogger("uvicorn.error").addFilter(RateLimitFilter())
        srv = self.config.server
        caps = connection_caps(srv.max_connections, srv.max_unix_connections, raise_nofile_limit())
        self.connections = ConnectionGuard(caps, srv.header_timeout, srv.max_header_bytes, srv.body_timeout,
                                           srv.send_timeout)
        sockets = [_tcp_listener(srv.host, srv.port, caps.backlog)]
        uds_ident = None
        if srv.unix_socket:
            uds, uds_ident = _unix_listener(srv.unix_socket, caps.backlog)
            sockets.append(uds)
        if caps.tcp < srv.max_connections:
            logger.warning("the open-file limit (%d) allows %d TCP connections, not server.max_connections=%d",
                           caps.nofile, caps.tcp, srv.max_connections)
        self.telemetry.start()
        path, overrides, recorded = self._boot_model()
        if path:
            configured = self._config_model()
            # a recorded model (or model.path with recorded overrides) falls back to plain model.path
            fallback = configured if recorded and configured and (configured != path or overrides) else None
            self._load_at_boot(path, overrides, fallback)
        app = build_app(self)
        grace = 1  # seconds uvicorn waits for open responses once told to exit
        # (the ignore: uvicorn annotates timeout_keep_alive int; it goes to loop.call_later, a float works)
        uconfig = uvicorn.Config(app, http=protocol_class(self.connections), lifespan="off", log_level="warning",
                                 log_config=None,  # uvicorn's loggers go through ours (logging.format)
                                 access_log=False, timeout_graceful_shutdown=grace, backlog=caps.backlog,
                                 timeout_keep_alive=srv.keepalive_timeout)  # type: ignore[arg-type]

        class _Server(uvicorn.Server):
            # SIGTERM/SIGINT are ours (drain first); uvicorn's serve() would otherwise take them and stop at once
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        server = _Server(uconfig)
        heap.freeze_long_lived()  # the app, the config, the imports: alive for the daemon's whole life
        tasks = [
            asyncio.create_task(self._supervise_loop()),
            asyncio.create_task(self._watchdog_loop()),
            asyncio.create_task(server.serve(sockets=sockets)),
        ]
        logger.info("listening on http://%s:%d%s", srv.host, srv.port, f" and unix:{srv.unix_socket}" if srv.unix_socket else "")
        await self._stop.wait()
        await self._drain()
        server.should_exit = True
        # let uvicorn send the responses that are ready (the 503s above) and close the connections
        await asyncio.wait({tasks[-1]}, timeout=grace + 1.0)
        for t in tasks:
            t.cancel()
        for t in list(self._tasks):
            t.cancel()
        for slot in (self.pending, self.active, *self.retiring):
            if slot is not None:
                await slot.stop()
        await asyncio.to_thread(self.telemetry.stop)
        if srv.unix_socket:
            _remove_own_socket(srv.unix_socket, uds_ident)
        self.zctx.destroy(linger=0)
        return 0

    async def _drain(self) -> None:
        """Stop accepting, let in-flight requests finish up to shutdown_timeout, abort the rest."""
        self.notifier.send("STOPPING=1")
        self.stopping = True
        slot = self.active
        if slot is None:
            return
        deadline = time.monotonic() + self.config.server.shutdown_timeout
        while slot.rm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rids = list(slot.rm.reqs)
        # fail first (rm.abort would forget them silently and leave their handlers waiting), then abort
        slot.rm.fail_all("the server is shutting down")
        await self._abort_in_scheduler(slot, rids)


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's errors (e.g. accept() out of file descriptors, repeated for every wake-up): logged
    once, then rate-limited."""
    exc = context.get("exception")
    message = context.get("message") or "asyncio error"
    _errors.log(f"loop:{message}:{type(exc).__name__}", logging.ERROR, "%s%s", message, f": {exc!r}" if exc else "")


def _setup_logging(config: DaemonConfig) -> None:
    logfmt.configure(config.logging.level, config.logging.format, "mllmd")


def run(config: DaemonConfig) -> int:
    """Run the daemon until SIGTERM; returns the exit status."""
    _setup_logging(config)
    try:
        return asyncio.run(Daemon(config).serve())
    except (OSError, RuntimeError, APIError) as e:
        logger.error("%s", e)
        return 1
