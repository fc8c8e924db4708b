"""A throw-away Debian root for the install test: debootstrap (minbase) once, cached as a tarball,
unpacked fresh for every run; /proc, /run, /tmp and /dev/shm mounted while in use and always
unmounted; the root deleted only once nothing is mounted under it.

The cache lives in $MLLMD_CI_CACHE (default /var/cache/mllmd-ci): the base root tarball (rebuilt
after 30 days) and apt's downloaded packages (shared by the runs, so only the first downloads).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE = Path(os.environ.get("MLLMD_CI_CACHE", "/var/cache/mllmd-ci"))
MAX_AGE_DAYS = 30
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CHROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def host_release() -> tuple[str, str]:
    """(ID, VERSION_CODENAME) of this machine."""
    info: dict[str, str] = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        info[key] = value.strip().strip('"')
    return info.get("ID", ""), info.get("VERSION_CODENAME", "")


def host_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


def host_debian_sources() -> str | None:
    """The host's deb822 source file for the Debian archive, if it has one (mirror and suites)."""
    for p in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        text = p.read_text()
        if "/debian" in text and "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in text:
            return text
    return None


def host_mirror(suite: str) -> str:
    text = host_debian_sources() or ""
    for stanza in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in stanza.splitlines()) if not k.startswith("#")
        )
        if suite in fields.get("Suites", "").split() and fields.get("URIs"):
            return fields["URIs"].split()[0]
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite and not parts[1].startswith("["):
                return parts[1]
    return DEFAULT_MIRROR


def host_apt_conf() -> dict[str, str]:
    """apt.conf.d snippets of the host that set how to reach the archive (proxy, date checks)."""
    out = {}
    for p in sorted(Path("/etc/apt/apt.conf.d").glob("*")):
        if p.is_file():
            text = p.read_text(errors="replace")
            if "Acquire::" in text and "IndexTargets" not in text:
                out[p.name] = text
    return out


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_tarball(suite: str, arch: str, log=print) -> Path:
    """The cached minbase root of SUITE/ARCH, made with debootstrap when missing or too old."""
    tarball = CACHE / f"{suite}-{arch}-minbase.tar"
    with _locked(CACHE / f"{suite}-{arch}.lock"):
        if tarball.exists() and time.time() - tarball.stat().st_mtime < MAX_AGE_DAYS * 86400:
            log(f"base root: cached {tarball}")
            return tarball
        mirror = host_mirror(suite)
        tmp = Path(tempfile.mkdtemp(prefix=f"debootstrap-{suite}-", dir=CACHE))
        try:
            log(f"base root: debootstrap --variant=minbase {suite} from {mirror} (once; cached in {tarball})")
            t0 = time.monotonic()
            run(["debootstrap", "--variant=minbase", f"--arch={arch}", suite, str(tmp / "root"), mirror],
                stdout=subprocess.DEVNULL)
            root = tmp / "root"
            leftover = mounts_under(root)
            if leftover:
                raise RuntimeError(f"debootstrap left mounts behind: {leftover}")
            # No downloaded packages in the tarball; device nodes stay (debootstrap made them).
            for d in (root / "var/cache/apt/archives").glob("*.deb"):
                d.unlink()
            run(["tar", "-C", str(root), "-cf", str(tmp / "root.tar"), "."])
            os.replace(tmp / "root.tar", tarball)
            log(f"base root: made in {time.monotonic() - t0:.0f} s")
        finally:
            safe_rmtree(tmp)
    return tarball


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below PATH (from /proc/self/mountinfo)."""
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp == prefix or mp.startswith(prefix + "/"):
            found.append(mp)
    return found


def safe_rmtree(path: Path) -> None:
    """rm -rf PATH, but never while anything is mounted below it."""
    if not path.exists():
        return
    left = mounts_under(path)
    if left:
        raise RuntimeError(f"not deleting {path}: still mounted there: {left}")
    shutil.rmtree(path)


class Chroot:
    """A fresh root unpacked from the base tarball; use as a context manager."""

    def __init__(self, suite: str, arch: str, log=print) -> None:
        self.suite, self.arch, self.log = suite, arch, log
        self.dir = Path(tempfile.mkdtemp(prefix="mllmd-install-test-", dir="/var/tmp"))
        self.root = self.dir / "root"
        self._mounted: list[Path] = []

    # ---- set-up / tear-down ------------------------------------------------------------------
    def __enter__(self) -> Chroot:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        tarball = base_tarball(self.suite, self.arch, self.log)
        self.root.mkdir()
        run(["tar", "-C", str(self.root), "-xf", str(tarball)])
        sources = host_debian_sources()
        if sources:
            (self.root / "etc/apt/sources.list").unlink(missing_ok=True)
            (self.root / "etc/apt/sources.list.d/debian.sources").write_text(sources)
        for name, text in host_apt_conf().items():
            (self.root / "etc/apt/apt.conf.d" / name).write_text(text)
        shutil.copy("/etc/resolv.conf", self.root / "etc/resolv.conf")
        # apt's downloads are kept between runs.
        archives = CACHE / f"apt-archives-{self.suite}-{self.arch}"
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        self._mount(["--bind", str(archives)], "var/cache/apt/archives")
        self._mount(["-t", "proc", "proc"], "proc")
        self._mount(["-t", "tmpfs", "-o", "mode=0755,nosuid,nodev", "tmpfs"], "run")
        self._mount(["-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs"], "tmp")
        self._mount(["-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs"], "dev/shm")

    def _mount(self, args: list[str], where: str) -> None:
        target = self.root / where
        target.mkdir(parents=True, exist_ok=True)
        run(["mount", *args, str(target)])
        self._mounted.append(target)

    def close(self) -> None:
        """Unmount everything (lazily if busy) and delete the root; never leaves a mount behind."""
        for target in reversed(self._mounted):
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(target)], capture_output=True)
        self._mounted.clear()
        # Anything else mounted below the root (by a package script, say) goes too.
        for mp in sorted(mounts_under(self.dir), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        left = mounts_under(self.dir)
        if left:
            raise RuntimeError(f"could not unmount {left}; {self.dir} is left in place")
        safe_rmtree(self.dir)

    # ---- running things inside ---------------------------------------------------------------
    def env(self, **extra: str) -> list[str]:
        base = {"PATH": CHROOT_PATH, "LANG": "C.UTF-8", "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
        base.update(extra)
        return ["env", "-i", *(f"{k}={v}" for k, v in base.items())]

    def sh(self, script: str, check: bool = True, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
        """Run a shell script inside (as root); returns the completed process (text output)."""
        cmd = ["chroot", str(self.root), *self.env(**env), "/bin/sh", "-c", script]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(
                f"in the chroot, `{script}` exited {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            )
        return done

    def popen(self, script: str, **env: str) -> subprocess.Popen:
        """Start a shell script inside in the background; its output goes to a file under self.dir."""
        cmd = ["chroot", str(self.root), *self.env(**env), "/bin/sh", "-c", script]
        with open(self.dir / "daemon.log", "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def snapshot(self) -> set[str]:
        """Every path of the root (files, folders, links), but the mounts and apt/dpkg bookkeeping."""
        skip = ("proc", "run", "tmp", "dev", "var/cache/apt", "var/lib/apt", "var/lib/dpkg", "var/log",
                "var/cache/debconf", "var/cache/ldconfig", "etc/ld.so.cache")
        out = set()
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel
            keep = []
            for d in dirnames:
                r = f"{rel}/{d}" if rel else d
                if r in skip:
                    continue
                keep.append(d)
                out.add("/" + r)
            dirnames[:] = keep
            for f in filenames:
                r = f"{rel}/{f}" if rel else f
                if r not in skip:
                    out.add("/" + r)
        return out
