"""systemd/mllmd.service and packaging/debian: static checks (fast; no package is built)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mllmd import __version__
from mllmd.daemon.config import DaemonConfig

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd/mllmd.service"
DEBIAN = REPO / "packaging/debian"

# Where the machine has no systemd-analyze the systemd checks skip, unless told they must run
# (.ci/run installs systemd first and sets this).
MUST_RUN = os.environ.get("MLLMD_REQUIRE_SYSTEMD_ANALYZE") == "1"


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        if MUST_RUN:
            pytest.fail("systemd-analyze is missing (apt-get install systemd)")
        pytest.skip("systemd-analyze is missing (apt-get install systemd)")
    return exe


def _unit() -> dict[str, list[str]]:
    """key -> values (a key may repeat); section names are ignored (no key is in two sections)."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(num) * units[unit or "s"]
    return total


@pytest.fixture(scope="module")
def verify_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root for `systemd-analyze verify --root`: the host's unit files, the unit under test in
    /etc/systemd/system, and stand-ins for the programs it runs (/usr/bin/mllmd is not installed
    here; /bin/kill is the real one)."""
    root = tmp_path_factory.mktemp("verify-root")
    for d in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(d).is_dir() and not Path(d).is_symlink():
            shutil.copytree(d, root / d.lstrip("/"), symlinks=True, dirs_exist_ok=True)
            break
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system/mllmd.service")
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    stub = root / "usr/bin/mllmd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy("/bin/kill", root / "bin/kill")
    return root


def test_systemd_analyze_verify(verify_root: Path) -> None:
    exe = _systemd_analyze()
    # --man=no: the man pages the unit names ship in the package, not on this machine.
    done = subprocess.run([exe, "verify", "--man=no", f"--root={verify_root}", "mllmd.service"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    # The check is real: a misspelt key is reported.
    broken = verify_root / "etc/systemd/system/mllmd.service"
    broken.write_text(UNIT.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    try:
        bad = subprocess.run([exe, "verify", "--man=no", f"--root={verify_root}", "mllmd.service"],
                             capture_output=True, text=True)
        assert "NoNewPrivilege" in bad.stderr
    finally:
        shutil.copy(UNIT, broken)


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    exe = _systemd_analyze()
    unit = tmp_path / "mllmd.service"
    shutil.copy(UNIT, unit)
    # --offline: judged from the file alone (systemd >= 250); --threshold is in tenths (40 = 4.0).
    done = subprocess.run([exe, "security", "--offline=yes", "--threshold=40", "--no-pager", str(unit)],
                          capture_output=True, text=True)
    if "--offline" in done.stderr and "unrecognized" in done.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    m = re.search(r"Overall exposure level for mllmd.service: (\d+\.\d+)", done.stdout)
    assert m, done.stdout + done.stderr
    score = float(m.group(1))
    print(f"systemd-analyze security --offline: exposure {score}")
    assert done.returncode == 0 and score <= 4.0, done.stdout


def test_unit_settings() -> None:
    u = _unit()

    def one(key: str) -> str:
        assert key in u, f"{key}= is missing"
        return u[key][-1]

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert _seconds(one("WatchdogSec")) > 0
    assert one("Restart") == "on-failure"
    assert "StartLimitIntervalSec" in u and "StartLimitBurst" in u
    assert one("User") == "mllmd" and one("Group") == "mllmd"
    assert one("SupplementaryGroups").split() == ["video", "render"]
    for key in ("RuntimeDirectory", "StateDirectory", "ConfigurationDirectory"):
        assert one(key) == "mllmd"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one("ExecStart").split()[0] == "/usr/bin/mllmd"
    # SIGTERM to the main process only: it drains, then stops its workers itself.
    assert one("KillMode") == "mixed"
    # Longer than the drain (server.shutdown_timeout) plus the workers' stop (5 s), with room.
    drain = DaemonConfig().server.shutdown_timeout
    assert _seconds(one("TimeoutStopSec")) >= drain + 15
    # Longer than a model load may take at boot before READY=1.
    assert _seconds(one("TimeoutStartSec")) > DaemonConfig().workers.ready_timeout
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectKernelLogs", "ProtectControlGroups", "RestrictNamespaces", "LockPersonality",
                "RestrictRealtime"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    assert one("SystemCallArchitectures") == "native"
    assert set(one("RestrictAddressFamilies").split()) <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # GPU device nodes must stay reachable; CUDA/Triton JIT needs writable+executable memory.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock", "MemoryDenyWriteExecute",
                "ProcSubset"):
        assert key not in u, f"{key}= would break GPU access or telemetry"


def test_unit_paths_match_the_default_config() -> None:
    cfg = DaemonConfig()
    u = _unit()
    assert cfg.server.unix_socket == f"/run/{u['RuntimeDirectory'][-1]}/mllmd.sock"
    assert "/var/lib/mllmd/models" in [str(p) for p in cfg.model.models_dir]
    assert "--config /etc/mllmd/mllmd.yaml" in u["ExecStart"][-1]


def test_changelog_version_is_the_package_version() -> None:
    first = (DEBIAN / "changelog").read_text().splitlines()[0]
    m = re.match(r"mllmd \(([^)]+)\) ", first)
    assert m, first
    assert re.split(r"[-+~]", m.group(1))[0] == __version__, (
        f"packaging/debian/changelog is at {m.group(1)}, mllmd at {__version__}: add a changelog entry"
    )


def _pins(python_version: str) -> dict[str, str]:
    """name -> pinned version in packaging/debian/venv-requirements.txt for that Python."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (DEBIAN / "venv-requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"python_version": python_version, "python_full_version": f"{python_version}.0"}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name.lower())
        (spec,) = req.specifier
        assert spec.operator == "==", f"{line}: pin an exact version"
        assert name not in pins, f"{name} is pinned twice for Python {python_version}"
        pins[name] = spec.version
    return pins


@pytest.mark.parametrize("python_version", ["3.10", "3.11", "3.12"])
def test_venv_requirements_pin_every_runtime_dependency(python_version: str) -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins(python_version)
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name.lower())
        if name in ("torch", "pillow"):  # from the target system: python3-pil, the system's torch (README.Debian)
            continue
        assert name in pins, f"{name} (pyproject.toml) is not pinned in packaging/debian/venv-requirements.txt"
        assert Version(pins[name]) in req.specifier, f"{name}=={pins[name]} does not satisfy {spec}"
    assert not {"torch", "numpy", "pillow", "triton", "flashinfer-python"} & set(pins)


def test_package_files() -> None:
    control = (DEBIAN / "control").read_text()
    assert "Architecture: any" in control
    for script in ("postinst", "prerm", "postrm", "rules", "finish-venv"):
        assert os.access(DEBIAN / script, os.X_OK), f"packaging/debian/{script} is not executable"
    for script in ("postinst", "prerm", "postrm"):
        assert "#DEBHELPER#" in (DEBIAN / script).read_text()
        subprocess.run(["sh", "-n", str(DEBIAN / script)], check=True)
    assert (DEBIAN / "mllmd.install").read_text().split() == ["etc/mllmd/mllmd.yaml", "etc/mllmd/"]
    assert (REPO / "etc/mllmd/mllmd.yaml").is_file()
    # The unit names man pages; the package makes them.
    manpages = (DEBIAN / "mllmd.manpages").read_text().split()
    for ref in re.findall(r"man:(\S+)\((\d)\)", UNIT.read_text()):
        assert f"debian/{ref[0]}.{ref[1]}" in manpages


def test_docs_the_readme_links_are_shipped() -> None:
    """The README installed in /usr/share/doc/mllmd links docs/*.md: those ship beside it (as docs/,
    so the relative links hold), or an operator reading it on the device follows a dead link."""
    shipped = (DEBIAN / "mllmd.docs").read_text().split()
    linked = set(re.findall(r"\]\((docs/[^)#]+)", (REPO / "README.md").read_text()))
    assert linked, "README.md links no docs/ page any more: update this test"
    for page in sorted(linked):
        assert (REPO / page).is_file(), page
        assert page in shipped or "docs" in shipped, f"{page} is linked from the packaged README but not shipped"
