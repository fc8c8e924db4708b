"""CPU, memory, swap and thermal readings from procfs and sysfs (every Linux machine).

Sources, relative to injectable roots (``/proc`` and ``/sys`` by default, a fake tree in tests):

- per-core utilization: deltas between two reads of ``/proc/stat`` (``cpuN`` lines); the first
  read has no utilization. Busy is everything but ``idle`` and ``iowait`` over ``user`` ..
  ``steal`` (``guest`` time is already inside ``user``/``nice``).
- per-core frequency: ``devices/system/cpu/cpuN/cpufreq/scaling_cur_freq`` (kHz -> Hz).
- per-core online: ``devices/system/cpu/cpuN/online``; a core without that file (cpu0 usually)
  takes the range list ``devices/system/cpu/online``, else counts as online when ``/proc/stat``
  lists it (the kernel lists online cores only).
- memory and swap: ``/proc/meminfo``; used memory is ``MemTotal - MemAvailable`` (what unified
  memory can still give), used swap is ``SwapTotal - SwapFree``.
- temperatures: ``class/thermal/thermal_zoneN/{type,temp}`` (millidegrees); a zone type that
  appears more than once is reported as ``type_zoneN``; unreadable or offline (-256) zones are skipped.

Anything missing or unreadable is left out of the sample, never reported as 0. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CpuTimes", "ProcfsReader", "ProcfsSample", "cpu_utilization", "parse_cpu_list", "parse_proc_stat"]

KIB = 1024
OFFLINE_SENSOR_C = -256.0

_CPU_DIR_RE = re.compile(r"cpu(\d+)")
_ZONE_RE = re.compile(r"thermal_zone(\d+)")


@dataclass(frozen=True)
class CpuTimes:
    """One core's cumulative jiffies from /proc/stat: idle (idle + iowait) and total."""

    idle: int
    total: int


@dataclass
class ProcfsSample:
    """What procfs/sysfs could tell at one moment; absent fields are None or missing keys."""

    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    swap_total_bytes: int | None = None
    cpu_utilization: dict[int, float] = field(default_factory=dict)
    cpu_frequency_hz: dict[int, int] = field(default_factory=dict)
    cpu_online: dict[int, bool] = field(default_factory=dict)
    temperatures_c: dict[str, float] = field(default_factory=dict)


def _read(path: Path) -> str | None:
    """A small file's text, or None when it is missing or unreadable."""
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except (OSError, ValueError):
        return None


def parse_proc_stat(text: str) -> dict[int, CpuTimes]:
    """Per-core times from /proc/stat text (the aggregate `cpu` line is skipped)."""
    out: dict[int, CpuTimes] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
            continue
        m = _CPU_DIR_RE.fullmatch(parts[0])
        if m is None:
            continue
        try:
            values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
        except ValueError:
            continue
        if len(values) < 4:
            continue
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        out[int(m.group(1))] = CpuTimes(idle=idle, total=sum(values))
    return out


def cpu_utilization(prev: dict[int, CpuTimes], cur: dict[int, CpuTimes]) -> dict[int, float]:
    """Busy fraction (0..1) per core between two /proc/stat reads; cores without progress are left out."""
    out: dict[int, float] = {}
    for core, now in cur.items():
        before = prev.get(core)
        if before is None:
            continue
        d_total = now.total - before.total
        if d_total <= 0:
            continue
        d_idle = now.idle - before.idle
        out[core] = min(max(1.0 - d_idle / d_total, 0.0), 1.0)
    return out


def parse_cpu_list(text: str) -> set[int]:
    """`'0-3,6'` (sysfs range list) -> {0, 1, 2, 3, 6}; bad pieces are ignored."""
    cores: set[int] = set()
    for piece in text.strip().split(","):
        lo, _, hi = piece.strip().partition("-")
        try:
            first = int(lo)
            last = int(hi) if hi else first
        except ValueError:
            continue
        cores.update(range(first, last + 1))
    return cores


def _parse_meminfo(text: str) -> dict[str, int]:
    """`MemTotal:  7852 kB` lines -> {'MemTotal': bytes}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = KIB if len(parts) > 1 and parts[1].lower() == "kb" else 1
        out[key.strip()] = int(parts[0]) * scale
    return out


class ProcfsReader:
    """Reads procfs/sysfs; keeps the previous /proc/stat read for utilization deltas."""

    def __init__(self, proc_root: str | Path = "/proc", sys_root: str | Path = "/sys") -> None:
        self.proc = Path(proc_root)
        self.sys = Path(sys_root)
        self._prev_stat: dict[int, CpuTimes] = {}

    @property
    def _cpu_dir(self) -> Path:
        return self.sys / "devices" / "system" / "cpu"

    def sample(self) -> ProcfsSample:
        """Read everything once."""
        out = ProcfsSample()
        self._read_memory(out)
        self._read_cpus(out)
        out.temperatures_c = self._read_thermal()
        return out

    def _read_memory(self, out: ProcfsSample) -> None:
        text = _read(self.proc / "meminfo")
        if text is None:
            return
        info = _parse_meminfo(text)
        total = info.get("MemTotal")
        available = info.get("MemAvailable")
        if total is not None and available is not None:
            out.memory_total_bytes = total
            out.memory_used_bytes = max(total - available, 0)
        swap_total, swap_free = info.get("SwapTotal"), info.get("SwapFree")
        if swap_total is not None and swap_free is not None:
            out.swap_total_bytes = swap_total
            out.swap_used_bytes = max(swap_total - swap_free, 0)

    def _sys_cores(self) -> list[int]:
        try:
            names = [p.name for p in self._cpu_dir.iterdir()]
        except OSError:
            return []
        return [int(m.group(1)) for m in map(_CPU_DIR_RE.fullmatch, names) if m is not None]

    def _read_cpus(self, out: ProcfsSample) -> None:
        stat_text = _read(self.proc / "stat")
        stat = parse_proc_stat(stat_text) if stat_text is not None else {}
        if stat:
            out.cpu_utilization = cpu_utilization(self._prev_stat, stat)
            self._prev_stat = stat
        online_text = _read(self._cpu_dir / "online")
        online_list = parse_cpu_list(online_text) if online_text is not None else None
        for core in sorted(set(self._sys_cores()) | set(stat)):
            core_dir = self._cpu_dir / f"cpu{core}"
            flag = _read(core_dir / "online")
            if flag is not None and flag.strip() in ("0", "1"):
                out.cpu_online[core] = flag.strip() == "1"
            elif online_list is not None:
                out.cpu_online[core] = core in online_list
            elif core in stat:
                out.cpu_online[core] = True
            khz = _read(core_dir / "cpufreq" / "scaling_cur_freq")
            if khz is not None and khz.strip().isdigit():
                out.cpu_frequency_hz[core] = int(khz.strip()) * 1000

    def _read_thermal(self) -> dict[str, float]:
        base = self.sys / "class" / "thermal"
        try:
            zones = sorted(
                (int(m.group(1)), base / name)
                for name in (p.name for p in base.iterdir())
                if (m := _ZONE_RE.fullmatch(name)) is not None
            )
        except OSError:
            return {}
        readings: list[tuple[int, str, float]] = []
        for index, zone in zones:
            kind, temp = _read(zone / "type"), _read(zone / "temp")
            if kind is None or temp is None or not kind.strip():
                continue
            try:
                celsius = int(temp.strip()) / 1000.0
            except ValueError:
                continue
            if celsius <= OFFLINE_SENSOR_C:
                continue
            readings.append((index, kind.strip(), celsius))
        counts: dict[str, int] = {}
        for _, kind, _ in readings:
            counts[kind] = counts.get(kind, 0) + 1
        return {(kind if counts[kind] == 1 else f"{kind}_zone{index}"): c for index, kind, c in readings}
