"""Parse NVIDIA Jetson ``tegrastats`` lines into one stable, typed sample.

``tegrastats`` prints one line per interval. Its fields drift between JetPack 4 (L4T R32) and
JetPack 7 (L4T R38/R39): an optional ``MM-DD-YYYY HH:MM:SS`` prefix, ``off`` CPU cores, EMC and
GR3D with or without a frequency, one GPU frequency per GPC (``@[305,305]``, Thor's ``@[0,0,0]``
with no utilization, or JetPack 5.0's separate ``GR3D2_FREQ``), engines printed as ``off``,
``x%@f``, ``NAME_FREQ @f`` or a bare number, temperatures as ``name@cur`` or ``name@cur/peak``,
power rails with or without ``mW`` as ``cur/avg`` or ``cur/avg/peak``, and irregular spacing.

This module turns any of those into a :class:`TegrastatsSample` whose :meth:`to_json_dict` has
exactly these keys (the contract the daemon's Prometheus gauges rely on):

``ram_used_bytes``, ``ram_total_bytes``
    ints; ``MB`` in tegrastats means 1048576 bytes.
``swap_used_bytes``, ``swap_total_bytes``
    ints, or null when the line has no ``SWAP`` field.
``cpus``
    list in core order of ``{"online": bool, "utilization": 0..1 | null, "frequency_hz": int | null}``.
    An ``off`` core is ``{"online": false, "utilization": null, "frequency_hz": null}``; an entry that
    cannot be read is reported online with null values so that core indices stay aligned.
``gpu_utilization``
    0..1 from ``GR3D_FREQ``, or null when the line has none (Thor prints only frequencies).
``gpu_frequency_hz``
    list, one entry per GPC (``GR3D_FREQ`` then ``GR3D2_FREQ``...); empty when absent; an entry
    that is not a number (``off``, ``N/A``) is null so that GPC indices stay aligned.
``emc_utilization``, ``emc_frequency_hz``
    0..1 and int, each null when absent.
``temperatures_c``
    sensor name as printed -> current value in Celsius; sensors reading -256 (offline) are omitted.
``power_mw``
    rail name as printed -> ``{"current": int, "average": int | null}`` in milliwatts.

Frequencies are printed in MHz and reported in Hz. Unknown fields (engines such as ``APE 150``,
``NVDEC off``, ``VIC_FREQ 0%@115``, ``MTS fg 0% bg 0%``, ``IRAM``...) are skipped, never fatal.
When a name repeats in one line (AGX Orin prints two ``NC`` rails), the first occurrence wins.

A line that is not tegrastats output, which here means it has no ``RAM used/total`` field, yields
no sample: :func:`parse_line` returns ``None`` and the command line skips it (prints nothing).

Command line: ``tegrastats | python -m mllmd.telemetry.tegrastats`` prints one JSON object per
tegrastats line read on stdin. This module uses the standard library only (no torch).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = [
    "CpuCore",
    "PowerRail",
    "TegrastatsSample",
    "iter_samples",
    "main",
    "parse_line",
]

MIB = 1024 * 1024
MHZ = 1_000_000
OFFLINE_SENSOR_C = -256.0

_UNIT_BYTES = {"kB": 1024, "KB": 1024, "MB": MIB, "GB": 1024 * MIB}
# Numbers are bounded so that a runaway digit string is skipped rather than overflowing.
_INT = r"\d{1,15}"
_NUM = rf"{_INT}(?:\.\d{{1,9}})?"

# `11-29-2026 07:22:18 RAM ...` (JetPack 5 and later print this prefix).
_TIMESTAMP_RE = re.compile(r"^\s*\d{1,2}-\d{1,2}-\d{4}\s+\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\s+")
# `(lfb 2x4MB)`, `(cached 0MB)`: nothing in them belongs to the contract.
_PAREN_RE = re.compile(r"\([^()]*\)")
# `RAM 2020/7852MB`, `SWAP 0/3936MB`, `IRAM 0/252kB`.
_MEM_RE = re.compile(rf"\b(RAM|SWAP|IRAM)\s+({_INT})\s*/\s*({_INT})\s*(kB|KB|MB|GB)(?![A-Za-z])")
# `CPU [9%@345,off,25%@345]` or the older `CPU [17%,13%,off]@408` (shared frequency).
_CPU_RE = re.compile(rf"\b(?i:cpu)\s*\[([^\[\]]*)\]\s*(?:@\s*({_NUM}))?")
_CPU_ENTRY_RE = re.compile(rf"({_NUM})\s*%?\s*(?:@\s*({_NUM}))?")
# `GR3D_FREQ 0%@[305,305]`, `GR3D_FREQ @[0,0,0]`, `GR3D_FREQ 28%@76`, `GR3D2_FREQ 0%@0`, `GR3D 3%@76`.
_GR3D_RE = re.compile(rf"\bGR3D(\d*)(?:_FREQ)?\s+(?:({_NUM})\s*%)?\s*(?:@\s*(?:\[([^\[\]]*)\]|({_NUM})))?")
# `EMC_FREQ 0%@2133`, `EMC_FREQ 0%`, `EMC_FREQ @4266`, `EMC 1%@408`.
_EMC_RE = re.compile(rf"\bEMC(?:_FREQ)?\s+(?:({_NUM})\s*%)?\s*(?:@\s*({_NUM}))?")
# `CPU@45.5C`, `soc012@33.781C`, `CV0@-256C`, `cpu@58.25C/61.75C` (current/peak).
_TEMP_RE = re.compile(rf"(?<![\w@%./\-])([A-Za-z][\w\-]*)@(-?{_NUM})C(?:/(-?{_NUM})C)?(?![\w.@%/])")
# `VDD_IN 5000mW/5000mW`, `POM_5V_IN 2000/2000`, `VDD_GPU 37528mW/37528mW/37528mW`, `VIN 5517mW`.
_RAIL_RE = re.compile(
    rf"(?<![\w@%./\-])([A-Za-z]\w*)\s+({_INT})(mW)?(?:/({_INT})(?:mW)?(?:/({_INT})(?:mW)?)?)?(?![\w.@%/])"
)
# Memory fields whose unit was unreadable must not turn into rails. (`CPU 618/618` is a real
# AGX Xavier rail on JetPack 4.2, so CPU is not excluded: the `CPU [...]` list is consumed first.)
_NOT_RAILS = frozenset({"RAM", "SWAP", "IRAM"})


@dataclass
class CpuCore:
    """One CPU core as tegrastats printed it."""

    online: bool
    utilization: float | None = None  # 0..1, relative to the core's current frequency
    frequency_hz: int | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """The contract's per-core object."""
        return {
            "online": self.online,
            "utilization": self.utilization,
            "frequency_hz": self.frequency_hz,
        }


@dataclass
class PowerRail:
    """One power rail in milliwatts: current, running average, and peak where printed."""

    current: int
    average: int | None = None
    peak: int | None = None  # JetPack 7 prints cur/avg/peak; not part of the JSON contract

    def to_json_dict(self) -> dict[str, Any]:
        """The contract's per-rail object (current and average only)."""
        return {"current": self.current, "average": self.average}


@dataclass
class TegrastatsSample:
    """One parsed tegrastats line; see the module docstring for the meaning of each field."""

    ram_used_bytes: int
    ram_total_bytes: int
    swap_used_bytes: int | None = None
    swap_total_bytes: int | None = None
    cpus: list[CpuCore] = field(default_factory=list)
    gpu_utilization: float | None = None
    gpu_frequency_hz: list[int | None] = field(default_factory=list)
    emc_utilization: float | None = None
    emc_frequency_hz: int | None = None
    temperatures_c: dict[str, float] = field(default_factory=dict)
    power_mw: dict[str, PowerRail] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with exactly the contract's keys."""
        return {
            "ram_used_bytes": self.ram_used_bytes,
            "ram_total_bytes": self.ram_total_bytes,
            "swap_used_bytes": self.swap_used_bytes,
            "swap_total_bytes": self.swap_total_bytes,
            "cpus": [cpu.to_json_dict() for cpu in self.cpus],
            "gpu_utilization": self.gpu_utilization,
            "gpu_frequency_hz": list(self.gpu_frequency_hz),
            "emc_utilization": self.emc_utilization,
            "emc_frequency_hz": self.emc_frequency_hz,
            "temperatures_c": dict(self.temperatures_c),
            "power_mw": {name: rail.to_json_dict() for name, rail in self.power_mw.items()},
        }


def _ratio(percent: str | None) -> float | None:
    """`'28'` -> 0.28, clamped to 0..1."""
    if percent is None:
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


def _hz(mhz: str | None) -> int | None:
    """`'921'` (MHz) -> 921000000 (Hz)."""
    if mhz is None:
        return None
    return round(float(mhz) * MHZ)


def _parse_cpus(entries: str, shared_mhz: str | None) -> list[CpuCore]:
    """Entries of `CPU [...]` in core order; `shared_mhz` is the old `]@Z` suffix."""
    if not entries.strip():
        return []
    cores: list[CpuCore] = []
    for entry in entries.split(","):
        text = entry.strip()
        if text.lower() == "off":
            cores.append(CpuCore(online=False))
            continue
        m = _CPU_ENTRY_RE.fullmatch(text)
        if m is None:
            cores.append(CpuCore(online=True))
            continue
        cores.append(CpuCore(True, _ratio(m.group(1)), _hz(m.group(2) or shared_mhz)))
    return cores


def _parse_gpc_list(text: str) -> list[int | None]:
    """`'305, 305'` -> [305000000, 305000000]; non-numbers become None."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        out.append(_hz(item) if re.fullmatch(_NUM, item) else None)
    return out


def parse_line(line: str) -> TegrastatsSample | None:
    """Parse one tegrastats line; None when the line has no `RAM used/total` field."""
    text = _TIMESTAMP_RE.sub(" ", line, count=1)
    text = _PAREN_RE.sub(" ", text)

    mem: dict[str, tuple[int, int]] = {}

    def take_mem(m: re.Match[str]) -> str:
        scale = _UNIT_BYTES[m.group(4)]
        mem.setdefault(m.group(1), (int(m.group(2)) * scale, int(m.group(3)) * scale))
        return " "

    text = _MEM_RE.sub(take_mem, text)
    if "RAM" not in mem:
        return None
    sample = TegrastatsSample(ram_used_bytes=mem["RAM"][0], ram_total_bytes=mem["RAM"][1])
    if "SWAP" in mem:
        sample.swap_used_bytes, sample.swap_total_bytes = mem["SWAP"]

    cpu_seen = False

    def take_cpu(m: re.Match[str]) -> str:
        nonlocal cpu_seen
        if not cpu_seen:
            cpu_seen = True
            sample.cpus = _parse_cpus(m.group(1), m.group(2))
        return " "

    text = _CPU_RE.sub(take_cpu, text)

    gpcs: dict[int, list[int | None]] = {}
    gpu_util: dict[int, float | None] = {}

    def take_gr3d(m: re.Match[str]) -> str:
        index = int(m.group(1)) if m.group(1) else 1
        percent, bracketed, single = m.group(2), m.group(3), m.group(4)
        if percent is None and bracketed is None and single is None:
            return m.group(0)  # `GR3D_FREQ off` or something else: leave it alone
        if index not in gpcs:
            gpu_util[index] = _ratio(percent)
            if bracketed is not None:
                gpcs[index] = _parse_gpc_list(bracketed)
            else:
                gpcs[index] = [] if single is None else [_hz(single)]
        return " "

    text = _GR3D_RE.sub(take_gr3d, text)
    sample.gpu_utilization = gpu_util.get(1)
    sample.gpu_frequency_hz = [hz for index in sorted(gpcs) for hz in gpcs[index]]

    emc_seen = False

    def take_emc(m: re.Match[str]) -> str:
        nonlocal emc_seen
        if m.group(1) is None and m.group(2) is None:
            return m.group(0)
        if not emc_seen:
            emc_seen = True
            sample.emc_utilization = _ratio(m.group(1))
            sample.emc_frequency_hz = _hz(m.group(2))
        return " "

    text = _EMC_RE.sub(take_emc, text)

    def take_temp(m: re.Match[str]) -> str:
        name, value = m.group(1), float(m.group(2))
        if value != OFFLINE_SENSOR_C and name not in sample.temperatures_c:
            sample.temperatures_c[name] = value
        return " "

    text = _TEMP_RE.sub(take_temp, text)

    for m in _RAIL_RE.finditer(text):
        name, current, unit, average, peak = m.groups()
        if name in _NOT_RAILS or (average is None and unit is None):
            continue  # `APE 150`, `VIC_FREQ 729`, `NVENC 716`: an engine clock, not a rail
        if name not in sample.power_mw:
            sample.power_mw[name] = PowerRail(
                int(current),
                None if average is None else int(average),
                None if peak is None else int(peak),
            )
    return sample


def iter_samples(lines: Iterable[str]) -> Iterator[TegrastatsSample]:
    """Parse many lines, skipping those that are not tegrastats output."""
    for line in lines:
        sample = parse_line(line)
        if sample is not None:
            yield sample


def _run(stdin: TextIO, stdout: TextIO) -> None:
    """Copy stdin to stdout as one JSON object per tegrastats line, flushing each."""
    for sample in iter_samples(stdin):
        stdout.write(json.dumps(sample.to_json_dict()) + "\n")
        stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m mllmd.telemetry.tegrastats`."""
    parser = argparse.ArgumentParser(
        prog="python -m mllmd.telemetry.tegrastats",
        description=(
            "Read tegrastats lines on stdin and print one JSON object per line. Lines that are "
            "not tegrastats output (no 'RAM used/total' field) are skipped."
        ),
    )
    parser.parse_args(argv)
    buffer = getattr(sys.stdin, "buffer", None)
    stdin = io.TextIOWrapper(buffer, encoding="utf-8", errors="replace") if buffer else sys.stdin
    try:
        _run(stdin, sys.stdout)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly, as other filters do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
