"""`mllmctl`: operate a running mllmd over its admin API (Unix socket by default, or TCP).

    mllmctl [--socket PATH | --url URL] [--admin-key KEY] [--config PATH] COMMAND
    commands: status [--json] | models [--json] | load-model PATH|NAME [--wait] | unload-model
              | drain | flush-cache | reload | requests [--json] | abort ID

Exit status: 0 done; 1 the daemon refused the operation; 2 bad usage, the daemon is unreachable or it
answered 401/403 (not authorised: no admin key, a wrong one, or no access to the socket).
Standard library only (it runs where torch is absent).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import stat
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from mllmd import knobs

DEFAULT_TIMEOUT = 30.0
START_HINT = ("Start it with `sudo systemctl start mllmd`, or point --socket (or MLLMD_SERVER__UNIX_SOCKET) "
              "at the socket of the one you run.")


class Unreachable(Exception):
    """The daemon cannot be reached, or refuses who we are (401/403) (exit status 2)."""


class Refused(Exception):
    """The daemon answered with an error (exit status 1)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Client:
    """A tiny JSON-over-HTTP client for the admin routes."""

    def __init__(self, socket_path: str | None, url: str | None, admin_key: str | None, timeout: float) -> None:
        self.socket_path, self.url, self.admin_key, self.timeout = socket_path, url, admin_key, timeout

    def _conn(self) -> http.client.HTTPConnection:
        if self.url:
            u = urlsplit(self.url)
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            return cls(u.hostname or "127.0.0.1", u.port, timeout=self.timeout)
        assert self.socket_path
        return _UnixConnection(self.socket_path, self.timeout)

    def where(self) -> str:
        return self.url or f"unix:{self.socket_path}"

    def _refused(self) -> str:
        """What a refused connection means here, and what to do about it."""
        if self.url:
            return (f"nothing listens at {self.url}: is mllmd running, with server.host / server.port "
                    f"set to that address? {START_HINT}")
        path = self.socket_path or ""
        try:
            is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
        except OSError:
            is_socket = True
        if not is_socket:
            return f"{path} is not a Unix socket; --socket takes the daemon's socket (server.unix_socket)"
        return f"nothing listens on {path} (left by a daemon that stopped?): mllmd is not running. {START_HINT}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        data = json.dumps(body).encode() if body is not None else None
        conn = self._conn()
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except PermissionError as e:
            raise Unreachable(f"permission denied on {self.where()} (are you in group mllmd?): {e}") from None
        except FileNotFoundError:
            raise Unreachable(f"no daemon socket at {self.socket_path}: is mllmd running? {START_HINT}") from None
        except ConnectionRefusedError:
            raise Unreachable(self._refused()) from None
        except (TimeoutError, ConnectionError, OSError) as e:
            raise Unreachable(f"cannot reach mllmd at {self.where()}: {e}") from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"error": {"message": raw.decode(errors="replace")[:200]}}
        if resp.status >= 400:
            err = payload.get("error") if isinstance(payload, dict) else None
            msg = err.get("message") if isinstance(err, dict) else str(payload)
            if resp.status in (401, 403):
                raise Unreachable(f"not authorised on {self.where()}: {msg}")
            raise Refused(f"{msg} (HTTP {resp.status})")
        return payload


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render_status(s: dict[str, Any]) -> str:
    lines = [f"state:    {s.get('state')}" + (f" ({s['reason']})" if s.get("reason") else "")]
    m = s.get("model")
    if m:
        lines.append(f"model:    {m.get('served_name')}  [{m.get('architecture')}, {m.get('dtype')}, "
                     f"quantization {m.get('quantization') or 'none'}]")
        lines.append(f"path:     {m.get('path')}")
        tt = m.get("tensor_transport")
        if tt:  # vision-language models: how images travel from the tokenizer worker to the GPU
            lines.append(f"images:   tensor transport {tt.get('mode')}"
                         + (f" (fallback: {tt['fallback_reason']})" if tt.get("fallback_reason") else ""))
    else:
        lines.append("model:    none")
    load = s.get("load") or {}
    if load.get("in_progress"):
        lines.append(f"loading:  {load.get('path')} {100 * (load.get('progress') or 0):.0f}% {load.get('stage') or ''}")
    elif load.get("error"):
        lines.append(f"last load failed: {load['error']}")
    req = s.get("requests") or {}
    line = f"requests: {req.get('running', 0)} running, {req.get('waiting', 0)} waiting"
    if req.get("retiring"):  # a model being swapped out still finishes these
        line += f", {req['retiring']} finishing on the previous model"
    lines.append(line)
    kv = s.get("kv_cache") or {}
    if kv:
        lines.append(f"kv cache: {100 * (kv.get('usage_ratio') or 0):.1f}% used of {kv.get('total_tokens')} tokens")
    st = s.get("state_cache") or {}
    if st:  # hybrid models (Qwen3.5): recurrent-state slots beside the KV cache
        lines.append(f"states:   {st.get('request_slots')} held by requests, {st.get('snapshot_slots')} snapshots, "
                     f"{st.get('free_slots')} free of {st.get('total_slots')} slots "
                     f"({_fmt_bytes(st.get('bytes_per_slot'))} each)")
    mem = s.get("memory") or {}
    if mem:
        lines.append(f"memory:   {_fmt_bytes(mem.get('used_bytes'))} used of {_fmt_bytes(mem.get('total_bytes'))}")
    lines.append(f"version:  {s.get('version')}   uptime {s.get('uptime_seconds', 0):.0f} s")
    for w in s.get("workers") or []:
        hb = w.get("seconds_since_heartbeat")
        lines.append(f"worker:   {w['name']:<12} pid {w.get('pid') or '-':<8} restarts {w.get('restarts', 0)}"
                     f"  heartbeat {'-' if hb is None else f'{hb:.1f} s ago'}")
    return "\n".join(lines)


def render_models(r: dict[str, Any]) -> str:
    rows = r.get("models") or []
    if not rows:
        return f"no models found under {', '.join(r.get('models_dirs') or [])}"
    cells = [("NAME", "ARCHITECTURE", "PARAMS", "DTYPE", "QUANT", "SIZE")]
    for m in rows:
        params = m.get("parameters")
        cells.append((str(m["name"]), str(m.get("architecture") or "-"), f"{params / 1e9:.2f}B" if params else "-",
                      str(m.get("dtype") or "-"), str(m.get("quantization") or "-"), _fmt_bytes(m.get("size_bytes"))))
    widths = [max(len(row[i]) for row in cells) for i in range(6)]
    right = (False, False, True, False, False, True)  # numbers right-aligned
    lines = ["  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)).rstrip() for row in cells]
    broken = [m for m in rows if m.get("error")]  # listed, but not loadable: say why under the table
    if broken:
        lines += ["", "not loadable:"] + [f"  {m['name']}: {m['error']}" for m in broken]
    return "\n".join(lines)


def _progress(client: Client, timeout: float) -> dict[str, Any]:
    """Poll status until the load ends; draw a progress bar on a terminal."""
    deadline = time.monotonic() + timeout
    tty = sys.stderr.isatty()
    while True:
        s = client.call("GET", "/admin/status")
        load = s.get("load") or {}
        frac = float(load.get("progress") or 0.0)
        if tty:
            bar = "#" * int(30 * frac)
            print(f"\rloading [{bar:<30}] {100 * frac:3.0f}% {load.get('stage') or ''}   ", end="", file=sys.stderr)
        if not load.get("in_progress"):
            if tty:
                print(file=sys.stderr)
            if load.get("error"):
                raise Refused(f"load failed: {load['error']}")
            return s
        if time.monotonic() > deadline:
            raise Refused(f"load still running after {timeout:.0f} s")
        time.sleep(0.5)


def _default_socket(config_path: str | None) -> str:
    from mllmd.daemon.config import load_config

    cfg = load_config(config_path)
    if not cfg.server.unix_socket:
        raise Unreachable("server.unix_socket is disabled in the configuration; use --url and --admin-key")
    return cfg.server.unix_socket


def _seconds(text: str) -> float:
    """A positive number of seconds (0 would time out at once, a negative one fails in the socket)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


def _url(text: str) -> str:
    """http(s)://HOST[:PORT]: without a scheme, urlsplit takes HOST for one and the call goes astray."""
    try:
        u = urlsplit(text)
        u.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad URL {text!r}: {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise argparse.ArgumentTypeError(f"want http://HOST:PORT, e.g. http://127.0.0.1:30000 (got {text!r})")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mllmctl", description="Operate a running mllmd.")
    ap.add_argument("--socket", help="daemon Unix socket (default: server.unix_socket from the config)")
    ap.add_argument("--url", type=_url, help="daemon base URL over TCP, e.g. http://127.0.0.1:30000 (needs --admin-key)")
    ap.add_argument("--admin-key", default=knobs.admin_key(), help="admin API key for --url")
    ap.add_argument("--config", help="mllmd configuration file (to find the socket)")
    ap.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, help="seconds per request")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, what in (("status", "state, model, requests, KV cache, memory and workers"),
                       ("models", "the model folders under model.models_dir, and which is loaded"),
                       ("requests", "the requests in flight: id, model, age (and the client's own id)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--json", action="store_true", help="print the raw JSON")
    p = sub.add_parser("abort", help="abort a request in flight (an id from `mllmctl requests`, or its group)")
    p.add_argument("id")
    p = sub.add_parser("load-model", help="load (or hot-swap to) a model folder or a name under models_dir")
    p.add_argument("model")
    p.add_argument("--wait", action="store_true", help="wait until loaded, with a progress bar")
    p.add_argument("--wait-timeout", type=_seconds, default=3600.0, help="seconds to wait for the load")
    for name, what in (("unload-model", "unload the model (requests get 503 until a load-model)"),
                       ("drain", "refuse new requests and let those in flight finish (a load-model ends it)"),
                       ("flush-cache", "empty the prefix cache"),
                       ("reload", "re-read the configuration file (the settings that apply without a restart)")):
        sub.add_parser(name, help=what)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    try:
        sock = None if args.url else (args.socket or _default_socket(args.config))
        client = Client(sock, args.url, args.admin_key, args.timeout)
        cmd = args.command
        if cmd == "status":
            s = client.call("GET", "/admin/status")
            print(json.dumps(s, indent=2) if args.json else render_status(s))
        elif cmd == "models":
            r = client.call("GET", "/admin/models")
            print(json.dumps(r, indent=2) if args.json else render_models(r))
        elif cmd == "load-model":
            r = client.call("POST", "/admin/models/load", {"model": args.model})
            if args.wait:
                s = _progress(client, args.wait_timeout)
                print(f"loaded {(s.get('model') or {}).get('served_name')}")
            else:
                print(r.get("message") or "loading")
        elif cmd == "requests":
            r = client.call("GET", "/admin/requests")
            rows = r.get("requests") or []
            if args.json:
                print(json.dumps(r, indent=2))
            elif not rows:
                print("no requests in flight")
            else:
                print("\n".join(f"{q['id']:<48} {q['model']:<24} {q['age_seconds']:>8.1f} s"
                                + (f"  client id {q['client_id']!r}" if q.get("client_id") else "") for q in rows))
        elif cmd == "abort":
            r = client.call("POST", "/abort_request", {"rid": args.id})
            print("aborted " + ", ".join(r.get("aborted") or []))
        elif cmd == "unload-model":
            print(client.call("POST", "/admin/models/unload").get("message") or "unloaded")
        elif cmd == "drain":
            print(client.call("POST", "/admin/drain").get("message") or "draining")
        elif cmd == "flush-cache":
            r = client.call("POST", "/admin/flush-cache")
            print(r.get("message") or "flushed")
        elif cmd == "reload":
            r = client.call("POST", "/admin/reload")
            print(r.get("message") or "reloaded")
        return 0
    except Refused as e:
        print(f"mllmctl: refused: {e}", file=sys.stderr)
        return 1
    except Unreachable as e:
        print(f"mllmctl: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `mllmctl status | head`
        return 0
    except Exception as e:  # a bad config file and the like
        print(f"mllmctl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
