"""Install test of the Debian package: build it, install it into a fresh Debian root, use it, remove
it, purge it.

    MLLMD_INSTALL_TEST=1 python -m pytest -m packaging tests/packaging -s

Needs root, debootstrap, the build dependencies (packaging/debian/control) and the network to the
Debian archive and the Python package index (.ci/run installs what is missing and runs this at its
end). Without MLLMD_INSTALL_TEST=1 it is skipped, saying so. Takes a few minutes; prints the time
of each phase. The chroot runs without systemd: the daemon is started the way the unit starts it
(same command, environment, user, groups, runtime folder, no-new-privileges, empty capability
bounding set), with a stand-in NOTIFY_SOCKET that checks READY=1, WATCHDOG=1 and STOPPING=1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from mllmd import __version__

REPO = Path(__file__).resolve().parents[2]
ENABLED = os.environ.get("MLLMD_INSTALL_TEST") == "1"

# About 4 minutes with warm caches (base root, apt's and pip's downloads); a cold first run more.
pytestmark = [pytest.mark.slow, pytest.mark.packaging, pytest.mark.timeout(1800)]


class Phases:
    """Prints each phase with its duration; the notes (steps skipped, and why) are printed last."""

    def __init__(self) -> None:
        self.t0 = self.t = time.monotonic()
        self.notes: list[str] = []

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        print(f"[install-test] {now - self.t0:6.1f} s  {name}", flush=True)
        self.t = now

    def note(self, text: str) -> None:
        print(f"[install-test] NOTE: {text}", flush=True)
        self.notes.append(text)


def _prerequisites() -> None:
    if not ENABLED:
        pytest.skip("the Debian install test runs only with MLLMD_INSTALL_TEST=1 (.ci/run sets it in its last step)")
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("debootstrap", "dpkg-buildpackage", "chroot", "mount", "lintian"):
        if shutil.which(tool) is None:
            missing.append(tool)
    from deb_chroot import host_release

    distro, suite = host_release()
    if distro != "debian" or not suite:
        missing.append(f"a Debian host (this is {distro} {suite}); the chroot is of the host's release")
    if missing:
        pytest.fail("the install test needs: " + ", ".join(missing))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotifySocket:
    """A stand-in for systemd's NOTIFY_SOCKET: collects the datagrams the daemon sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.extend(data.decode(errors="replace").splitlines())

    def wait_for(self, line: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if line in self.messages:
                return True
            time.sleep(0.1)
        return line in self.messages

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


def _unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _http(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _build(out: Path, phase: Phases) -> Path:
    phase("build: packaging/build-deb.sh --lintian")
    # xz -1: the package's contents are what is tested, not its compression (dpkg's default is 6).
    env = dict(os.environ, MLLMD_DEB_XZ_LEVEL=os.environ.get("MLLMD_DEB_XZ_LEVEL", "1"))
    done = subprocess.run(["bash", str(REPO / "packaging/build-deb.sh"), "--lintian", str(out)],
                          capture_output=True, text=True, env=env)
    tags = [ln for ln in done.stdout.splitlines() if re.match(r"^[EWO]: mllmd", ln)]
    print("[install-test] lintian errors and warnings:\n  " + "\n  ".join(tags or ["(none)"]))
    assert done.returncode == 0, f"build-deb.sh failed\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    # Warnings too: each one fixed or overridden with its reason (debian/mllmd.lintian-overrides).
    assert not [t for t in tags if t.startswith(("E:", "W:"))], tags
    debs = sorted(out.glob(f"mllmd_{__version__}*_*.deb"))
    assert len(debs) == 1, debs
    size = debs[0].stat().st_size
    print(f"[install-test] {debs[0].name}: {size / 2**20:.1f} MiB")
    assert size < 60 * 2**20, "the package is unexpectedly large (torch inside?)"
    listing = subprocess.run(["dpkg-deb", "-c", str(debs[0])], capture_output=True, text=True, check=True).stdout
    assert "/site-packages/torch/" not in listing and "/site-packages/numpy/" not in listing
    return debs[0]


def test_deb_install_remove_purge(tmp_path: Path) -> None:
    _prerequisites()
    from deb_chroot import Chroot, host_arch, host_release

    phase = Phases()
    prebuilt = os.environ.get("MLLMD_INSTALL_TEST_DEB")  # a .deb built before: skip the build (development)
    deb = Path(prebuilt) if prebuilt else _build(tmp_path / "dist", phase)
    _, suite = host_release()

    phase(f"chroot: fresh {suite} minbase root")
    with Chroot(suite, host_arch(), log=lambda m: print(f"[install-test]         {m}", flush=True)) as ch:
        ch.sh("apt-get update -q")
        before = ch.snapshot()
        packages_before = set(ch.sh("dpkg-query -W -f '${Package}\\n'").stdout.split())
        shutil.copy(deb, ch.path("/tmp") / deb.name)

        phase("apt-get install ./mllmd_*.deb (dependencies from the Debian archive)")
        done = ch.sh(f"apt-get install -y /tmp/{deb.name}", timeout=900)
        assert re.search(r"^ii\s+mllmd\s", ch.sh("dpkg -l mllmd").stdout, re.M)
        brought = set(ch.sh("dpkg-query -W -f '${Package}\\n'").stdout.split()) - packages_before - {"mllmd"}
        print(f"[install-test]         apt brought {len(brought)} packages from the archive: {' '.join(sorted(brought))}")
        _check_installed(ch, done.stdout + done.stderr)

        phase("daemon: start as the unit would (no model), mllmctl status, /metrics, load-model, SIGTERM")
        _exercise_daemon(ch, phase)

        phase("apt-get remove mllmd")
        ch.sh("apt-get remove -y mllmd")
        _check_removed(ch)

        phase("apt-get purge mllmd (a user-supplied model in /var/lib/mllmd/models)")
        done = ch.sh("apt-get purge -y mllmd")
        _check_purged(ch, done.stdout + done.stderr, kept_model="tiny-qwen3")
        ch.sh("rm -r /var/lib/mllmd")  # what the purge message says to do

        phase("install again, purge at once (no models): nothing is left")
        ch.sh(f"apt-get install -y /tmp/{deb.name}")
        done = ch.sh("apt-get purge -y mllmd")
        out = done.stdout + done.stderr
        assert "purge left" not in out, out
        _check_purged(ch, out, kept_model=None)

        phase("apt-get purge the dependencies it brought: the root is as it was before")
        ch.sh(f"apt-get purge -y --autoremove {' '.join(sorted(brought))}")
        after = ch.snapshot()
        # The shadow tools' backups of the user database (written by any user creation/deletion).
        backups = {"/etc/passwd-", "/etc/group-", "/etc/shadow-", "/etc/gshadow-"}
        # netbase's postinst writes /etc/hosts when the root has none (a minbase root has none) and its
        # purge keeps it, as the administrator's file; python3-pil brings netbase (mime-support ->
        # mailcap -> perl -> netbase).
        backups |= {"/etc/hosts"} if "netbase" in brought else set()
        added = sorted(after - before - backups)
        removed = sorted(before - after)
        assert not added and not removed, f"left behind: {added[:50]}\nremoved: {removed[:50]}"
        # The Python modules, the daemon's ZMQ ipc folders, caches: nothing named after mllmd.
        found = ch.sh("find / -xdev \\( -path /proc -o -path /var/log -o -path /var/lib/dpkg -o -path /tmp \\) "
                      "-prune -o -name '*mllmd*' -print").stdout.split()
        assert not found, found
        assert not ch.sh("getent passwd mllmd; getent group mllmd", check=False).stdout.strip()
    phase("done: chroot unmounted and deleted")
    for note in phase.notes:
        print(f"[install-test] SKIPPED STEP: {note}")
        warnings.warn(f"install test: step skipped: {note}", stacklevel=1)


def _check_installed(ch, apt_output: str) -> None:
    version = ch.sh("mllmd --version").stdout.strip()
    assert version == f"mllmd {__version__}", version
    # The default configuration (the conffile) is valid, read by root and by the service user.
    ch.sh("mllmd check-config >/dev/null")
    ch.sh("setpriv --reuid=mllmd --regid=mllmd --init-groups mllmd check-config --config /etc/mllmd/mllmd.yaml >/dev/null")
    # torch is not there, and the package did not bring it.
    assert ch.sh("/usr/lib/mllmd/bin/python3 -c 'import torch'", check=False).returncode != 0
    assert ch.sh("/usr/lib/mllmd/bin/python3 -c 'import numpy, transformers, tokenizers'").returncode == 0
    passwd = ch.sh("getent passwd mllmd").stdout.strip().split(":")
    assert passwd[5] == "/var/lib/mllmd" and passwd[6] == "/usr/sbin/nologin", passwd
    groups = ch.sh("id -nG mllmd").stdout.split()
    assert "mllmd" in groups and "video" in groups, groups  # render: only where it exists
    stat = ch.sh("stat -c '%U:%G %a %n' /var/lib/mllmd /var/lib/mllmd/models /etc/mllmd/mllmd.yaml").stdout.splitlines()
    assert stat == ["mllmd:mllmd 750 /var/lib/mllmd", "mllmd:mllmd 2770 /var/lib/mllmd/models",
                    "root:mllmd 640 /etc/mllmd/mllmd.yaml"], stat
    assert "/etc/mllmd/mllmd.yaml" in ch.sh("cat /var/lib/dpkg/info/mllmd.conffiles").stdout
    # Enabled for systemd, not started (no systemd here: deb-systemd-invoke's guard).
    assert ch.path("/etc/systemd/system/multi-user.target.wants/mllmd.service").is_symlink()
    # postinst byte-compiled the environment (the service sees /usr read-only).
    assert ch.sh("find /usr/lib/mllmd -name '*.pyc' | head -1").stdout.strip()
    assert "mllmd: note:" not in apt_output, apt_output[-3000:]  # postinst could not byte-compile


def _exercise_daemon(ch, phase: Phases) -> None:
    unit = _unit_settings(ch.path("/lib/systemd/system/mllmd.service").read_text())
    exec_start = unit["ExecStart"][-1]
    env = {}
    for line in unit.get("Environment", []):
        for item in shlex.split(line):
            k, _, v = item.partition("=")
            env[k] = v
    user, group = unit["User"][-1], unit["Group"][-1]
    # What systemd does before ExecStart: the folders, the environment, the notify socket.
    rmode = unit.get("RuntimeDirectoryMode", ["0755"])[-1]
    ch.sh(f"install -d -o {user} -g {group} -m {rmode} /run/mllmd && "
          f"install -d -o {user} -g {group} -m 0750 /var/cache/mllmd")
    notify = NotifySocket(ch.path("/run/notify.sock"))
    port = _free_port()
    env.update(RUNTIME_DIRECTORY="/run/mllmd", STATE_DIRECTORY="/var/lib/mllmd", CACHE_DIRECTORY="/var/cache/mllmd",
               CONFIGURATION_DIRECTORY="/etc/mllmd", HOME="/var/lib/mllmd", USER=user, LOGNAME=user,
               NOTIFY_SOCKET="/run/notify.sock", WATCHDOG_USEC="2000000")
    umask = unit.get("UMask", ["0022"])[-1]
    cmd = (f"umask {umask} && exec setpriv --reuid={user} --regid={group} --init-groups --no-new-privs "
           f"--inh-caps=-all --bounding-set=-all {exec_start} --server.port {port}")
    proc = ch.popen(cmd, **env)
    log = ch.dir / "daemon.log"
    try:
        ready = notify.wait_for("READY=1", 60)
        assert ready, f"no READY=1 within 60 s; notify: {notify.messages}\n{log.read_text()[-4000:]}"
        assert proc.poll() is None, log.read_text()[-4000:]
        sock = ch.path("/run/mllmd/mllmd.sock")
        st = sock.stat()
        assert oct(st.st_mode & 0o777) == "0o660", oct(st.st_mode)
        code, body = _http(f"http://127.0.0.1:{port}/health")
        assert code in (200, 503), (code, body)  # 503: up, no model

        # The admin API over the Unix socket: as root and as a member of group mllmd.
        admin = True
        if admin:  # always: the admin API and mllmctl are part of the package
            done = ch.sh("mllmctl status")
            print("[install-test]         mllmctl status:\n" + done.stdout.rstrip())
            ch.sh("setpriv --reuid=mllmd --regid=mllmd --init-groups mllmctl status >/dev/null")
            st_json = json.loads(ch.sh("mllmctl status --json").stdout)
            assert st_json, st_json
            # Someone outside group mllmd is refused by the socket's permissions.
            other = ch.sh("setpriv --reuid=nobody --regid=nogroup --clear-groups "
                          "mllmctl --socket /run/mllmd/mllmd.sock status", check=False)
            assert other.returncode != 0 and "ermission denied" in other.stderr, other.stderr

        code, body = _http(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and "mllmd_up" in body and "mllmd_memory_total_bytes" in body, (code, body[:500])

        # A real (tiny, random-weight) model, but no torch: load-model fails and says what is
        # missing; the daemon stays up. The model is what an administrator would copy in.
        from mllmd.testing.checkpoints import build_tiny_checkpoint

        model = build_tiny_checkpoint(ch.dir / "model-src", "Qwen3-0.6B", seed=1)
        shutil.copytree(model, ch.path("/var/lib/mllmd/models/tiny-qwen3"))
        ch.sh("chmod -R a+rX /var/lib/mllmd/models/tiny-qwen3")  # as an administrator's copy would be
        if admin:
            done = ch.sh("mllmctl load-model /var/lib/mllmd/models/tiny-qwen3 --wait --wait-timeout 120",
                         check=False, timeout=180)
            out = done.stdout + done.stderr
            print(f"[install-test]         mllmctl load-model (no torch): exit {done.returncode}: {out.strip()}")
            assert done.returncode != 0, out
            assert "torch" in out.lower(), f"the error does not name torch: {out}"
            assert proc.poll() is None, "the daemon died on a failed load"
            ch.sh("mllmctl status >/dev/null")

        assert notify.wait_for("WATCHDOG=1", 5), notify.messages
    finally:
        stopped = proc.poll() is not None
        if not stopped:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        notify.close()
        print("[install-test]         daemon log (tail):\n" + "\n".join(log.read_text().splitlines()[-15:]))
    assert not stopped, "the daemon exited by itself"
    assert rc == 0, f"the daemon exited {rc} on SIGTERM"
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
    assert "STOPPING=1" in notify.messages, notify.messages
    assert not ch.path("/run/mllmd/mllmd.sock").exists()


def _check_removed(ch) -> None:
    assert re.search(r"^rc\s+mllmd\s", ch.sh("dpkg -l mllmd").stdout, re.M)
    for gone in ("/usr/lib/mllmd", "/usr/bin/mllmd", "/usr/bin/mllmctl", "/lib/systemd/system/mllmd.service"):
        assert not ch.path(gone).exists() and not ch.path(gone).is_symlink(), f"{gone} is still there after remove"
    for kept in ("/etc/mllmd/mllmd.yaml", "/var/lib/mllmd/models/tiny-qwen3/config.json"):
        assert ch.path(kept).exists(), f"{kept} went away on remove"
    assert ch.sh("getent passwd mllmd").stdout.strip()


def _check_purged(ch, output: str, kept_model: str | None) -> None:
    assert not ch.sh("dpkg -l mllmd 2>/dev/null | grep -E '^(ii|rc)'", check=False).stdout.strip()
    for gone in ("/etc/mllmd", "/var/cache/mllmd", "/run/mllmd", "/usr/lib/mllmd",
                 "/etc/systemd/system/multi-user.target.wants/mllmd.service"):
        assert not ch.path(gone).exists() and not ch.path(gone).is_symlink(), f"{gone} is still there after purge"
    assert not ch.sh("getent passwd mllmd; getent group mllmd", check=False).stdout.strip()
    if kept_model is None:
        assert not ch.path("/var/lib/mllmd").exists()
        return
    # The purge names what it left; exactly that is left.
    print("[install-test]         purge said: " + " | ".join(ln for ln in output.splitlines() if ln.startswith("mllmd:")))
    assert "purge left /var/lib/mllmd/models" in output and f"mllmd:   {kept_model}" in output, output
    left = ch.sh("find /var/lib/mllmd -maxdepth 2 | sort").stdout.split()
    assert left == ["/var/lib/mllmd", "/var/lib/mllmd/models", f"/var/lib/mllmd/models/{kept_model}"], left
    owners = set(ch.sh("find /var/lib/mllmd -printf '%u:%g\\n'").stdout.split())
    assert owners == {"root:root"}, owners
    found = ch.sh("find / -xdev \\( -path /proc -o -path /var/log -o -path /var/lib/dpkg -o -path /tmp \\) "
                  "-prune -o -name '*mllmd*' -print").stdout.split()
    assert sorted(found) == ["/var/lib/mllmd"], found
