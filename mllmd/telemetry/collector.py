"""Device telemetry for /metrics: picks the sources, samples them on a thread, merges a snapshot.

Sources, chosen automatically at :meth:`TelemetryCollector.start`:

- procfs/sysfs everywhere (CPU, memory, swap, thermal zones): :mod:`mllmd.telemetry.procfs`;
- on Jetson, a ``tegrastats --interval N`` child when ``tegrastats_path`` (or its name on PATH)
  is executable: :mod:`mllmd.telemetry.tegrastats_source`;
- otherwise NVML when ``nvml`` is on and ``pynvml`` works: :mod:`mllmd.telemetry.nvml`.

Merging: tegrastats values win for the fields they have (memory, swap, per-core CPU values, GPU,
EMC, power; its temperature list replaces the thermal zones when it has one), then NVML's, then
procfs's. A tegrastats sample older than ``stale_after`` (the child died or hangs) is ignored, so
its fields fall back or disappear. A field no source has stays None / empty and is omitted from
/metrics. Sampling runs on a daemon thread every ``interval`` seconds; :meth:`latest` never blocks
on I/O. Standard library only (no torch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mllmd.telemetry.nvml import NvmlSample, NvmlSource
from mllmd.telemetry.procfs import ProcfsReader, ProcfsSample
from mllmd.telemetry.tegrastats import TegrastatsSample
from mllmd.telemetry.tegrastats_source import TegrastatsSource, resolve_tegrastats

__all__ = ["TelemetryCollector", "TelemetrySnapshot", "merge_snapshot"]

logger = logging.getLogger("mllmd.telemetry")

_DEFAULTS: dict[str, Any] = {"enabled": True, "interval": 1.0, "tegrastats_path": "/usr/bin/tegrastats", "nvml": True}


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Device readings at one moment, one field per /metrics family; None / empty: no source."""

    timestamp: float = 0.0  # time.time() of the sample
    sources: tuple[str, ...] = ()  # e.g. ("procfs", "tegrastats")
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    swap_total_bytes: int | None = None
    cpu_utilization: Mapping[int, float] = field(default_factory=dict)  # core -> 0..1
    cpu_frequency_hz: Mapping[int, int] = field(default_factory=dict)  # core -> Hz
    cpu_online: Mapping[int, bool] = field(default_factory=dict)  # core -> online
    gpu_utilization: float | None = None
    gpu_frequency_hz: Mapping[int, int] = field(default_factory=dict)  # GPC -> Hz
    emc_utilization: float | None = None
    emc_frequency_hz: int | None = None
    temperatures_c: Mapping[str, float] = field(default_factory=dict)  # sensor -> Celsius
    power_watts: Mapping[str, float] = field(default_factory=dict)  # rail -> W (current)
    power_average_watts: Mapping[str, float] = field(default_factory=dict)  # rail -> W (average)
    gpu_memory_used_bytes: int | None = None  # NVML only (discrete GPUs)
    gpu_memory_total_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (for admin status)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, dict):
                out[key] = {str(k): v for k, v in value.items()}
        out["sources"] = list(self.sources)
        return out


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def merge_snapshot(
    procfs: ProcfsSample | None,
    nvml: NvmlSample | None = None,
    tegra: TegrastatsSample | None = None,
    timestamp: float | None = None,
) -> TelemetrySnapshot:
    """One snapshot from what each source has; tegrastats wins, then NVML, then procfs."""
    p = procfs or ProcfsSample()
    sources = tuple(name for name, s in (("procfs", procfs), ("nvml", nvml), ("tegrastats", tegra)) if s is not None)
    util, freq, online = dict(p.cpu_utilization), dict(p.cpu_frequency_hz), dict(p.cpu_online)
    temps: dict[str, float] = dict(p.temperatures_c)
    gpu_util = gpu_mem_used = gpu_mem_total = emc_util = emc_freq = None
    gpcs: dict[int, int] = {}
    power: dict[str, float] = {}
    power_avg: dict[str, float] = {}
    mem_used, mem_total = p.memory_used_bytes, p.memory_total_bytes
    swap_used, swap_total = p.swap_used_bytes, p.swap_total_bytes
    if nvml is not None:
        gpu_util, emc_util, emc_freq = nvml.gpu_utilization, nvml.memory_utilization, nvml.memory_frequency_hz
        if nvml.gpu_frequency_hz is not None:
            gpcs = {0: nvml.gpu_frequency_hz}
        if nvml.temperature_c is not None:
            temps["gpu"] = nvml.temperature_c
        if nvml.power_w is not None:
            power["gpu"] = nvml.power_w
        gpu_mem_used, gpu_mem_total = nvml.gpu_memory_used_bytes, nvml.gpu_memory_total_bytes
    if tegra is not None:
        mem_used, mem_total = tegra.ram_used_bytes, tegra.ram_total_bytes
        if tegra.swap_total_bytes is not None:
            swap_used, swap_total = tegra.swap_used_bytes, tegra.swap_total_bytes
        for core, cpu in enumerate(tegra.cpus):
            online[core] = cpu.online
            if cpu.utilization is not None:
                util[core] = cpu.utilization
            if cpu.frequency_hz is not None:
                freq[core] = cpu.frequency_hz
            if not cpu.online:  # an `off` core has no utilization or clock, whatever procfs read
                util.pop(core, None)
                freq.pop(core, None)
        gpu_util = _first(tegra.gpu_utilization, gpu_util)
        tegra_gpcs = {i: hz for i, hz in enumerate(tegra.gpu_frequency_hz) if hz is not None}
        gpcs = tegra_gpcs or gpcs
        emc_util = _first(tegra.emc_utilization, emc_util)
        emc_freq = _first(tegra.emc_frequency_hz, emc_freq)
        if tegra.temperatures_c:
            temps = dict(tegra.temperatures_c)
        if tegra.power_mw:
            power = {name: rail.current / 1000.0 for name, rail in tegra.power_mw.items()}
            power_avg = {n: r.average / 1000.0 for n, r in tegra.power_mw.items() if r.average is not None}
    return TelemetrySnapshot(
        timestamp=time.time() if timestamp is None else timestamp,
        sources=sources,
        memory_used_bytes=mem_used,
        memory_total_bytes=mem_total,
        swap_used_bytes=swap_used,
        swap_total_bytes=swap_total,
        cpu_utilization=util,
        cpu_frequency_hz=freq,
        cpu_online=online,
        gpu_utilization=gpu_util,
        gpu_frequency_hz=gpcs,
        emc_utilization=emc_util,
        emc_frequency_hz=emc_freq,
        temperatures_c=temps,
        power_watts=power,
        power_average_watts=power_avg,
        gpu_memory_used_bytes=gpu_mem_used,
        gpu_memory_total_bytes=gpu_mem_total,
    )


def _setting(settings: Any, name: str) -> Any:
    """`settings.name` or `settings[name]`, else the default (TelemetrySection, a dict, or None)."""
    if isinstance(settings, Mapping):
        return settings.get(name, _DEFAULTS[name])
    return getattr(settings, name, _DEFAULTS[name])


class TelemetryCollector:
    """Samples the available sources every `interval` seconds on a thread.

    `settings` is the daemon's `TelemetrySection` (or a dict, or None for defaults): `enabled`,
    `interval` (seconds), `tegrastats_path`, `nvml`. `on_snapshot` is called (on the sampling
    thread) with each new snapshot, e.g. `Metrics.set_telemetry`. The keyword arguments after it
    exist for tests.
    """

    def __init__(
        self,
        settings: Any = None,
        *,
        on_snapshot: Callable[[TelemetrySnapshot], None] | None = None,
        proc_root: str | Path = "/proc",
        sys_root: str | Path = "/sys",
        nvml_module: Any | None = None,
        tegrastats_backoff: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.enabled = bool(_setting(settings, "enabled"))
        self.interval = float(_setting(settings, "interval"))
        self.tegrastats_path = str(_setting(settings, "tegrastats_path") or "")
        self.use_nvml = bool(_setting(settings, "nvml"))
        self.stale_after = max(5 * self.interval, 3.0)
        self.on_snapshot = on_snapshot
        self.procfs = ProcfsReader(proc_root, sys_root)
        self.tegrastats: TegrastatsSource | None = None
        self.nvml: NvmlSource | None = None
        self._nvml_module = nvml_module
        self._backoff = tegrastats_backoff
        self._snapshot = TelemetrySnapshot()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def sources(self) -> list[str]:
        """Sources in use: procfs always, plus tegrastats or nvml."""
        names = ["procfs"]
        if self.tegrastats is not None:
            names.append("tegrastats")
        if self.nvml is not None:
            names.append("nvml")
        return names

    def start(self) -> None:
        """Pick the sources, take a first sample now, then keep sampling on a daemon thread."""
        if not self.enabled or self._thread is not None:
            return
        self._stop.clear()
        binary = resolve_tegrastats(self.tegrastats_path)
        if binary is not None:
            initial, cap = self._backoff
            self.tegrastats = TegrastatsSource(binary, self.interval, backoff_initial=initial, backoff_max=cap)
            self.tegrastats.start()
        elif self.use_nvml:
            self.nvml = NvmlSource.open(self._nvml_module)
        logger.info("telemetry sources: %s", ", ".join(self.sources))
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="mllmd-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling, the tegrastats child and NVML."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(2 * self.interval, 2.0))
            self._thread = None
        if self.tegrastats is not None:
            self.tegrastats.stop()
            self.tegrastats = None
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None

    def latest(self) -> TelemetrySnapshot:
        """The newest snapshot (empty before the first sample or when disabled)."""
        return self._snapshot

    def sample_once(self) -> TelemetrySnapshot:
        """Read every source once, merge, publish and return the snapshot."""
        try:
            procfs = self.procfs.sample()
        except Exception:  # a strange procfs must not stop telemetry
            logger.exception("procfs telemetry failed")
            procfs = None
        nvml = None
        if self.nvml is not None:
            try:
                nvml = self.nvml.sample()
            except Exception:
                logger.exception("NVML telemetry failed")
        tegra = None
        if self.tegrastats is not None:
            self.tegrastats.check_hung()
            tegra = self.tegrastats.latest(max_age=self.stale_after)
        snapshot = merge_snapshot(procfs, nvml, tegra)
        self._snapshot = snapshot
        if self.on_snapshot is not None:
            try:
                self.on_snapshot(snapshot)
            except Exception:
                logger.exception("telemetry on_snapshot callback failed")
        return snapshot

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_once()
