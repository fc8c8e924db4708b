"""End-to-end fixtures: the real `mllmd` daemon as a subprocess on the tiny CPU test model.

`start_daemon` launches `python -m mllmd.cli --config /dev/null --model.path ... --server.port P
--server.unix_socket S` in its own process group, waits (bounded) for `/health` to answer 200 and
returns a `DaemonProc`. `DaemonProc.stop()` sends SIGTERM and asserts exit status 0 within a bound;
anything left over in the group is killed. Fixtures built on it share one daemon per module.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

READY_TIMEOUT = 90.0  # model load on a busy 2-core CI box
STOP_TIMEOUT = 20.0
# Test clients drop an idle connection after 2 s, before the daemon's server.keepalive_timeout (5 s)
# closes it: at httpx's default expiry, also 5 s, a request could go out on a connection the server
# was closing at that moment ("Server disconnected without sending a response", seen in the soak).
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=2.0)
REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTED_SITE = Path(__file__).resolve().parent / "scripted_site"  # its sitecustomize installs the scripted sampler


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TMPDIRS: list[Path] = []


def short_tmpdir(prefix: str = "mllmd-t-") -> Path:
    """A short private directory (AF_UNIX paths are limited to 107 bytes); removed at session end."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _TMPDIRS.append(d)
    return d


@pytest.fixture(scope="session", autouse=True)
def _remove_short_tmpdirs() -> Iterator[None]:
    yield
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of the direct children of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid != pid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry.name), cmd))
    return out


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    port: int
    uds: str
    workdir: Path
    log_path: Path
    model_path: Path
    api_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- addresses and clients ---------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 30.0, **kw: Any) -> httpx.Client:
        kw.setdefault("limits", CLIENT_LIMITS)
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers(), **kw)

    def uds_http(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=self.uds, limits=CLIENT_LIMITS), base_url="http://localhost",
            timeout=timeout, headers=self.headers(),
        )

    def openai(self, http_client: httpx.Client | None = None, base_url: str | None = None, **kw: Any) -> Any:
        import openai

        if http_client is None:
            http_client = httpx.Client(limits=CLIENT_LIMITS)
        return openai.OpenAI(
            base_url=base_url or f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0,
            timeout=kw.pop("timeout", 60.0), http_client=http_client, **kw,
        )

    # ---- state -------------------------------------------------------------------------------
    def health(self, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
        r = httpx.get(f"{self.base_url}/health", timeout=timeout)
        return r.status_code, r.json()

    def wait_health(self, want: int = 200, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """Poll /health until it answers `want` (bounded); returns the body."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                code, body = self.health(timeout=2.0)
                last = (code, body)
                if code == want:
                    return body
            except (httpx.HTTPError, ValueError) as e:
                last = e
            time.sleep(0.1)
        raise AssertionError(f"/health did not answer {want} within {timeout} s (last: {last})\n{self.log_tail()}")

    def workers(self) -> dict[str, int]:
        """worker name -> pid of the daemon's live worker processes."""
        out = {}
        for pid, cmd in children_of(self.proc.pid):
            for name in ("tokenizer", "scheduler", "detokenizer"):
                if f"mllmd.workers.{name}_worker" in cmd and pid_alive(pid):
                    out[name] = pid
        return out

    def worker_pid(self, name: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.workers().get(name)
            if pid is not None:
                return pid
            time.sleep(0.05)
        raise AssertionError(f"no {name} worker found under pid {self.proc.pid}\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "---- daemon log (tail) ----\n" + "\n".join(lines[-n:])

    # ---- shutdown ----------------------------------------------------------------------------
    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait (bounded), kill leftovers; returns the exit status (None -> AssertionError)."""
        if self.proc.poll() is None:
            kids = [pid for pid, _ in children_of(self.proc.pid)]
            for pid in kids:  # a SIGSTOPped worker left by a test would never see SIGTERM
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                code: int | None = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        else:
            code = self.proc.returncode
        self.kill_group()
        return code  # type: ignore[return-value]

    def kill_group(self) -> None:
        """SIGKILL whatever is left in the daemon's process group (only processes this test started)."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


class NotifyListener:
    """A bound AF_UNIX datagram socket (the daemon's NOTIFY_SOCKET), read by a background thread so
    that the daemon never finds it full; collects (monotonic time, line) for every message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify-listener", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.monotonic()
            self.messages.extend((now, line) for line in data.decode(errors="replace").splitlines())

    def drain(self, seconds: float) -> None:
        """Let `seconds` pass (messages keep being collected)."""
        time.sleep(seconds)

    def wait_for(self, line: str, timeout: float) -> float:
        """Wait until `line` has arrived (bounded); returns its arrival time."""
        deadline = time.monotonic() + timeout
        while True:
            for t, got in list(self.messages):
                if got == line:
                    return t
            if time.monotonic() > deadline:
                raise AssertionError(f"{line!r} not received within {timeout} s; got {self.lines()}")
            time.sleep(0.02)

    def lines(self) -> list[str]:
        return [m for _, m in list(self.messages)]

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self.sock.close()


def daemon_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLLMD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def start_daemon(
    model_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
    wait: bool = True,
    ready_timeout: float = READY_TIMEOUT,
    nofile: int | None = None,
) -> DaemonProc:
    """Start the daemon (own process group) and, with `wait`, block until /health is 200.
    `nofile`: its open-file limit (soft and hard, as `ulimit -n` sets them)."""
    workdir = short_tmpdir()
    port = free_port()
    uds = str(workdir / "mllmd.sock")
    log_path = workdir / "daemon.log"
    argv = [
        sys.executable, "-m", "mllmd.cli", "--config", "/dev/null",
        "--model.path", str(model_path), "--model.models_dir", str(model_path.parent),
        "--server.port", str(port), "--server.unix_socket", uds,
        "--server.shutdown_timeout", "3", *args,
    ]
    if api_key:
        argv += ["--server.api_key", api_key]
    full_env = daemon_env({"RUNTIME_DIRECTORY": str(workdir), "STATE_DIRECTORY": str(workdir), **(env or {})})
    if full_env.get("MLLMD_TESTING_SCRIPT"):  # scripted output: injected into the scheduler worker from here
        full_env["PYTHONPATH"] = str(SCRIPTED_SITE) + os.pathsep + full_env["PYTHONPATH"]
    def limit_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, cwd=workdir, start_new_session=True,
                                preexec_fn=limit_files if nofile is not None else None)
    d = DaemonProc(proc, port, uds, workdir, log_path, model_path, api_key)
    if wait:
        try:
            d.wait_health(200, ready_timeout)
        except BaseException:
            d.stop(5)
            raise
    return d


def stop_and_check(d: DaemonProc, timeout: float = STOP_TIMEOUT) -> None:
    """Teardown: SIGTERM must end the daemon with status 0 within `timeout`, workers included."""
    pid = d.proc.pid
    kids = [p for p, _ in children_of(pid)]
    code = d.stop(timeout)
    leftovers = [p for p in kids if pid_alive(p)]
    ipc_dirs = [p.name for p in d.workdir.glob("ipc-*")]
    log = d.log_tail()
    shutil.rmtree(d.workdir, ignore_errors=True)
    assert code == 0, f"daemon exit status {code} after SIGTERM (expected 0 within {timeout} s)\n{log}"
    assert not leftovers, f"worker processes {leftovers} outlived the daemon\n{log}"
    assert not ipc_dirs, f"the daemon left its IPC directory behind: {ipc_dirs}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen3 checkpoint with the real tokenizer (built once per session)."""
    from mllmd.testing.checkpoints import build_tiny_checkpoint

    return Path(build_tiny_checkpoint(tmp_path_factory.mktemp("daemon_model") / "tiny-qwen3", "Qwen3-0.6B"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def daemon(tiny_model: Path) -> Iterator[DaemonProc]:
    """One plain daemon per module (tests that need other settings start their own)."""
    d = start_daemon(tiny_model)
    yield d
    stop_and_check(d)


@pytest.fixture
def daemon_factory(tiny_model: Path) -> Iterator[Any]:
    """start(*args, **kw) -> DaemonProc; every daemon started is stopped (and checked) at teardown."""
    started: list[DaemonProc] = []

    def start(*args: str, **kw: Any) -> DaemonProc:
        d = start_daemon(tiny_model, *args, **kw)
        started.append(d)
        return d

    yield start
    errors = []
    for d in started:
        try:
            stop_and_check(d)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)
