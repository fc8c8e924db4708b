"""Telemetry sources: procfs/sysfs on fake trees, NVML with a fake module, and a fake `tegrastats`
child (tests/telemetry/fake_tegrastats, printing real lines) driven end to end into /metrics."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mllmd.daemon.config import TelemetrySection
from mllmd.daemon.metrics import Metrics
from mllmd.telemetry.collector import TelemetryCollector, merge_snapshot
from mllmd.telemetry.nvml import NvmlSource
from mllmd.telemetry.procfs import CpuTimes, ProcfsReader, cpu_utilization, parse_cpu_list, parse_proc_stat
from mllmd.telemetry.tegrastats import parse_line
from mllmd.telemetry.tegrastats_source import TegrastatsSource, resolve_tegrastats

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_tegrastats"
MB = 1048576
MHZ = 1_000_000
TELEMETRY_NAMES = {
    "mllmd_memory_used_bytes", "mllmd_memory_total_bytes", "mllmd_swap_used_bytes", "mllmd_swap_total_bytes",
    "mllmd_cpu_utilization_ratio", "mllmd_cpu_frequency_hertz", "mllmd_cpu_online", "mllmd_gpu_utilization_ratio",
    "mllmd_gpu_frequency_hertz", "mllmd_emc_utilization_ratio", "mllmd_emc_frequency_hertz",
    "mllmd_temperature_celsius", "mllmd_power_watts", "mllmd_power_average_watts", "mllmd_gpu_memory_used_bytes",
    "mllmd_gpu_memory_total_bytes",
}
NVML_ONLY = {"mllmd_gpu_memory_used_bytes", "mllmd_gpu_memory_total_bytes"}  # Jetson's memory is the RAM


def _load_fake_lines() -> dict[str, str]:
    spec = importlib.util.spec_from_loader("fake_tegrastats", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(FAKE.read_text(), str(FAKE), "exec"), module.__dict__)
    return dict(module.LINES)


FAKE_LINES = _load_fake_lines()


def wait_for(pred: Callable[[], Any], timeout: float = 15.0, step: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def telemetry_samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of the telemetry families in render()."""
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name in TELEMETRY_NAMES:
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def names_of(samples: dict[tuple[str, Any], float]) -> set[str]:
    return {name for name, _ in samples}


def value(samples: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# --------------------------------------------------------------------------------------------
# procfs / sysfs
# --------------------------------------------------------------------------------------------

STAT_1 = """cpu  400 0 200 1400 0 0 0 0 0 0
cpu0 100 0 50 800 50 0 0 0 0 0
cpu1 300 0 150 500 50 0 0 0 0 0
intr 12345
ctxt 999
"""
# cpu0: +100 busy (user 60, system 20, irq 10, steal 10), +100 idle (idle 80, iowait 20) -> 0.5
# cpu1: +0 busy, +200 idle -> 0.0
STAT_2 = """cpu  500 0 220 1700 0 0 0 0 0 0
cpu0 160 0 70 880 70 10 0 10 5 0
cpu1 300 0 150 700 50 0 0 0 0 0
"""
MEMINFO = """MemTotal:        8000000 kB
MemFree:         1000000 kB
MemAvailable:    3000000 kB
Buffers:          100000 kB
SwapTotal:       2000000 kB
SwapFree:        1500000 kB
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_tree(tmp_path: Path, *, cores: int = 2, stat: str = STAT_1) -> tuple[Path, Path]:
    """A /proc and /sys with two cores (cpu0 lacks `online`, cpu1 lacks cpufreq) and thermal zones."""
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    write(proc / "stat", stat)
    write(proc / "meminfo", MEMINFO)
    cpu = sys_ / "devices" / "system" / "cpu"
    write(cpu / "cpu0" / "cpufreq" / "scaling_cur_freq", "1190400\n")
    write(cpu / "cpu1" / "online", "1\n")
    for extra in range(2, cores):
        write(cpu / f"cpu{extra}" / "online", "0\n")
    (cpu / "cpufreq").mkdir(parents=True, exist_ok=True)  # not a core
    thermal = sys_ / "class" / "thermal"
    write(thermal / "thermal_zone0" / "type", "cpu-thermal\n")
    write(thermal / "thermal_zone0" / "temp", "45500\n")
    write(thermal / "thermal_zone1" / "type", "acpitz\n")
    write(thermal / "thermal_zone1" / "temp", "30000\n")
    write(thermal / "thermal_zone2" / "type", "acpitz\n")
    write(thermal / "thermal_zone2" / "temp", "31000\n")
    write(thermal / "thermal_zone3" / "type", "CV0-therm\n")
    write(thermal / "thermal_zone3" / "temp", "-256000\n")  # offline sensor
    write(thermal / "thermal_zone4" / "type", "no-temp\n")  # unreadable: skipped
    write(thermal / "cooling_device0" / "type", "fan\n")
    return proc, sys_


def test_proc_stat_parsing_and_utilization_math() -> None:
    a, b = parse_proc_stat(STAT_1), parse_proc_stat(STAT_2)
    assert set(a) == {0, 1}  # the aggregate line and non-cpu lines are skipped
    assert a[0] == CpuTimes(idle=850, total=1000)
    util = cpu_utilization(a, b)
    assert util[0] == pytest.approx(0.5)
    assert util[1] == pytest.approx(0.0)
    assert cpu_utilization({}, b) == {}  # the first read has no utilization
    assert cpu_utilization(b, b) == {}  # no progress: no reading rather than a made-up one
    # guest time is inside user: adding it must not change the total.
    assert parse_proc_stat("cpu0 10 0 0 10 0 0 0 0 7 3\n")[0] == CpuTimes(idle=10, total=20)


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,6\n") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("5") == {5}
    assert parse_cpu_list("") == set()


def test_procfs_reader_on_fake_tree(tmp_path: Path) -> None:
    proc, sys_ = fake_tree(tmp_path, cores=3)
    reader = ProcfsReader(proc, sys_)
    first = reader.sample()
    assert first.cpu_utilization == {}
    assert first.memory_total_bytes == 8000000 * 1024
    assert first.memory_used_bytes == 5000000 * 1024
    assert first.swap_total_bytes == 2000000 * 1024
    assert first.swap_used_bytes == 500000 * 1024
    # cpu0: no `online` file, listed in /proc/stat -> online; cpu2: offline, not in /proc/stat.
    assert first.cpu_online == {0: True, 1: True, 2: False}
    assert first.cpu_frequency_hz == {0: 1190400 * 1000}  # cpu1 has no cpufreq: omitted
    assert first.temperatures_c == {"cpu-thermal": 45.5, "acpitz_zone1": 30.0, "acpitz_zone2": 31.0}
    write(proc / "stat", STAT_2)
    second = reader.sample()
    assert second.cpu_utilization == pytest.approx({0: 0.5, 1: 0.0})


def test_procfs_online_range_list(tmp_path: Path) -> None:
    proc, sys_ = fake_tree(tmp_path)
    cpu = sys_ / "devices" / "system" / "cpu"
    (cpu / "cpu1" / "online").unlink()
    write(cpu / "online", "1\n")  # only cpu1 online per the range list
    assert ProcfsReader(proc, sys_).sample().cpu_online == {0: False, 1: True}


def test_procfs_missing_everything(tmp_path: Path) -> None:
    sample = ProcfsReader(tmp_path / "noproc", tmp_path / "nosys").sample()
    assert sample.memory_used_bytes is None and sample.swap_total_bytes is None
    assert not sample.cpu_utilization and not sample.cpu_online and not sample.temperatures_c


def test_procfs_partial_meminfo(tmp_path: Path) -> None:
    write(tmp_path / "proc" / "meminfo", "MemTotal: 1000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    sample = ProcfsReader(tmp_path / "proc", tmp_path / "sys").sample()
    assert sample.memory_total_bytes is None  # no MemAvailable: no pair, nothing made up
    assert (sample.swap_used_bytes, sample.swap_total_bytes) == (0, 0)  # no swap is a real 0


def test_collector_procfs_only_gauges(tmp_path: Path) -> None:
    """Only what the fake tree has appears in /metrics: no GPU, EMC or power families at all."""
    proc, sys_ = fake_tree(tmp_path)
    metrics = Metrics()
    collector = TelemetryCollector(
        TelemetrySection(interval=0.05, tegrastats_path=str(tmp_path / "absent" / "tegrastats"), nvml=False),
        on_snapshot=metrics.set_telemetry, proc_root=proc, sys_root=sys_,
    )
    collector.start()
    try:
        assert collector.sources == ["procfs"]
        write(proc / "stat", STAT_2)
        wait_for(lambda: collector.latest().cpu_utilization)
    finally:
        collector.stop()
    samples = telemetry_samples(metrics)
    assert names_of(samples) == {
        "mllmd_memory_used_bytes", "mllmd_memory_total_bytes", "mllmd_swap_used_bytes", "mllmd_swap_total_bytes",
        "mllmd_cpu_utilization_ratio", "mllmd_cpu_frequency_hertz", "mllmd_cpu_online", "mllmd_temperature_celsius",
    }
    assert value(samples, "mllmd_cpu_utilization_ratio", core="0") == pytest.approx(0.5)
    assert value(samples, "mllmd_cpu_frequency_hertz", core="0") == 1190400000
    assert ("mllmd_cpu_frequency_hertz", (("core", "1"),)) not in samples
    assert value(samples, "mllmd_memory_used_bytes") == 5000000 * 1024
    assert value(samples, "mllmd_temperature_celsius", sensor="cpu-thermal") == 45.5
    assert collector.latest().sources == ("procfs",)


def test_collector_with_no_sources_reports_nothing(tmp_path: Path) -> None:
    metrics = Metrics()
    collector = TelemetryCollector({"interval": 0.05, "tegrastats_path": "", "nvml": False},
                                   on_snapshot=metrics.set_telemetry, proc_root=tmp_path, sys_root=tmp_path)
    collector.start()
    collector.stop()
    assert telemetry_samples(metrics) == {}


def test_collector_disabled(tmp_path: Path) -> None:
    collector = TelemetryCollector({"enabled": False}, proc_root=tmp_path, sys_root=tmp_path)
    collector.start()
    assert collector.latest().sources == ()
    collector.stop()


# --------------------------------------------------------------------------------------------
# NVML
# --------------------------------------------------------------------------------------------


class FakeNvml:
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, fail_init: bool = False, broken: tuple[str, ...] = ()) -> None:
        self.fail_init = fail_init
        self.broken = broken
        self.shutdown = False
        self.index: int | None = None

    def _check(self, name: str) -> None:
        if name in self.broken:
            raise RuntimeError(f"{name}: Not Supported")

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.index = index
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self._check("util")
        return SimpleNamespace(gpu=73, memory=41)

    def nvmlDeviceGetClockInfo(self, handle: str, kind: int) -> int:
        self._check("clock")
        return 1980 if kind == self.NVML_CLOCK_GRAPHICS else 2619

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        self._check("temp")
        return 54

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        self._check("power")
        return 123456

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(used=10 * MB, total=100 * MB, free=90 * MB)


def test_nvml_sample_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    fake = FakeNvml()
    source = NvmlSource.open(fake)
    assert source is not None and fake.index == 3
    s = source.sample()
    assert s.gpu_utilization == pytest.approx(0.73)
    assert s.memory_utilization == pytest.approx(0.41)
    assert s.gpu_frequency_hz == 1980 * MHZ and s.memory_frequency_hz == 2619 * MHZ
    assert s.temperature_c == 54.0 and s.power_w == pytest.approx(123.456)
    assert (s.gpu_memory_used_bytes, s.gpu_memory_total_bytes) == (10 * MB, 100 * MB)
    source.close()
    assert fake.shutdown


def test_nvml_absent_or_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert NvmlSource.open() is None
    assert NvmlSource.open(FakeNvml(fail_init=True)) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden
    assert NvmlSource.open(FakeNvml()) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    source = NvmlSource.open(FakeNvml())
    assert source is not None and source.handle == "GPU-1234"


def test_nvml_unsupported_queries_are_omitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    metrics = Metrics()
    collector = TelemetryCollector({"interval": 0.05, "tegrastats_path": "", "nvml": True},
                                   on_snapshot=metrics.set_telemetry, proc_root=tmp_path, sys_root=tmp_path,
                                   nvml_module=FakeNvml(broken=("power", "clock")))
    collector.start()
    collector.stop()
    samples = telemetry_samples(metrics)
    assert names_of(samples) == {"mllmd_gpu_utilization_ratio", "mllmd_emc_utilization_ratio", "mllmd_temperature_celsius",
                                 "mllmd_gpu_memory_used_bytes", "mllmd_gpu_memory_total_bytes"}
    assert value(samples, "mllmd_temperature_celsius", sensor="gpu") == 54.0


def test_collector_nvml_gauges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    proc, sys_ = fake_tree(tmp_path)
    metrics = Metrics()
    collector = TelemetryCollector({"interval": 0.05, "tegrastats_path": "", "nvml": True},
                                   on_snapshot=metrics.set_telemetry, proc_root=proc, sys_root=sys_,
                                   nvml_module=FakeNvml())
    collector.start()
    collector.stop()
    samples = telemetry_samples(metrics)
    assert value(samples, "mllmd_gpu_utilization_ratio") == pytest.approx(0.73)
    assert value(samples, "mllmd_gpu_frequency_hertz", gpc="0") == 1980 * MHZ
    assert value(samples, "mllmd_emc_frequency_hertz") == 2619 * MHZ
    assert value(samples, "mllmd_power_watts", rail="gpu") == pytest.approx(123.456)
    assert value(samples, "mllmd_temperature_celsius", sensor="gpu") == 54.0
    assert value(samples, "mllmd_temperature_celsius", sensor="cpu-thermal") == 45.5
    assert "mllmd_power_average_watts" not in names_of(samples)
    # the discrete GPU's own memory (it was read for /admin/status only)
    assert (value(samples, "mllmd_gpu_memory_used_bytes"), value(samples, "mllmd_gpu_memory_total_bytes")) == (10 * MB, 100 * MB)
    nvml_off = TelemetryCollector({"interval": 0.05, "tegrastats_path": "", "nvml": False},
                                  proc_root=proc, sys_root=sys_, nvml_module=FakeNvml())
    nvml_off.start()
    nvml_off.stop()
    assert nvml_off.latest().gpu_utilization is None


# --------------------------------------------------------------------------------------------
# Merging
# --------------------------------------------------------------------------------------------


def test_tegrastats_values_win(tmp_path: Path) -> None:
    proc, sys_ = fake_tree(tmp_path)
    reader = ProcfsReader(proc, sys_)
    reader.sample()
    write(proc / "stat", STAT_2)
    procfs = reader.sample()
    tegra = parse_line(FAKE_LINES["TX2_DENVER_OFF"])
    snap = merge_snapshot(procfs, None, tegra, timestamp=1.0)
    assert snap.sources == ("procfs", "tegrastats")
    assert snap.memory_used_bytes == 2344 * MB and snap.swap_total_bytes == 3926 * MB
    assert snap.cpu_online == {0: True, 1: False, 2: False, 3: True, 4: True, 5: True}
    assert snap.cpu_utilization == pytest.approx({0: 0.01, 3: 0.01, 4: 0.0, 5: 0.02})  # core 1 is off
    assert snap.cpu_frequency_hz == {0: 345 * MHZ, 3: 345 * MHZ, 4: 345 * MHZ, 5: 345 * MHZ}
    assert "cpu-thermal" not in snap.temperatures_c and snap.temperatures_c["GPU"] == 35.0
    assert snap.gpu_frequency_hz == {0: 624 * MHZ} and snap.gpu_utilization == 0.0
    assert snap.power_watts["VDD_IN"] == pytest.approx(3.056)
    assert snap.power_average_watts["VDD_SYS_DDR"] == pytest.approx(0.883)
    assert merge_snapshot(procfs).temperatures_c["cpu-thermal"] == 45.5
    assert snap.to_dict()["cpu_online"]["1"] is False


def test_tegrastats_without_temperatures_keeps_thermal_zones(tmp_path: Path) -> None:
    proc, sys_ = fake_tree(tmp_path)
    tegra = parse_line("RAM 100/200MB CPU [10%@100]")
    snap = merge_snapshot(ProcfsReader(proc, sys_).sample(), None, tegra)
    assert snap.temperatures_c["cpu-thermal"] == 45.5
    assert snap.swap_total_bytes == 2000000 * 1024  # tegrastats had no SWAP: procfs fills in
    assert snap.cpu_frequency_hz == {0: 100 * MHZ}  # tegrastats wins for core 0
    assert snap.gpu_utilization is None and not snap.gpu_frequency_hz and not snap.power_watts


# --------------------------------------------------------------------------------------------
# tegrastats child
# --------------------------------------------------------------------------------------------


def test_fake_lines_are_the_cited_real_lines() -> None:
    spec = importlib.util.spec_from_file_location("_tegrastats_lines", HERE / "tegrastats_lines.py")
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    for name, line in FAKE_LINES.items():
        assert getattr(cases, name) == line, name
        assert parse_line(line) is not None


def test_fake_tegrastats_honours_interval() -> None:
    start = time.monotonic()
    out = subprocess.run([str(FAKE), "--interval", "200"], env={**os.environ, "FAKE_TEGRASTATS_EXIT_AFTER": "3"},
                         capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - start
    assert out.returncode == 1 and len(out.stdout.splitlines()) == 3
    assert elapsed >= 0.4
    assert subprocess.run([str(FAKE), "--interval", "x"], capture_output=True, timeout=30).returncode == 2


def test_resolve_tegrastats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_tegrastats(str(FAKE)) == str(FAKE)
    assert resolve_tegrastats("") is None
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert resolve_tegrastats("/usr/bin/tegrastats-does-not-exist") is None
    (bindir / "tegrastats").symlink_to(FAKE)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    assert resolve_tegrastats("/nonexistent/tegrastats") == str(bindir / "tegrastats")


def test_fake_tegrastats_on_path_drives_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a `tegrastats` on PATH -> child -> parser -> collector -> Metrics.render()."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shutil.copy(FAKE, bindir / "tegrastats")
    log = tmp_path / "starts.log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_TEGRASTATS_LINE", "ORIN_NX8_JP6")
    monkeypatch.setenv("FAKE_TEGRASTATS_LOG", str(log))
    proc, sys_ = fake_tree(tmp_path)
    metrics = Metrics()
    settings = TelemetrySection(interval=0.05, tegrastats_path="/nonexistent/bin/tegrastats", nvml=True)
    collector = TelemetryCollector(settings, on_snapshot=metrics.set_telemetry, proc_root=proc, sys_root=sys_,
                                   nvml_module=FakeNvml())
    collector.start()
    try:
        assert collector.sources == ["procfs", "tegrastats"]  # NVML is not used beside tegrastats
        wait_for(lambda: "tegrastats" in collector.latest().sources)
        samples = telemetry_samples(metrics)
    finally:
        collector.stop()
    assert log.read_text().split()[1:] == ["--interval", "50"]
    assert names_of(samples) == TELEMETRY_NAMES - NVML_ONLY
    assert value(samples, "mllmd_memory_used_bytes") == 6982 * MB
    assert value(samples, "mllmd_memory_total_bytes") == 7620 * MB
    assert value(samples, "mllmd_swap_used_bytes") == 2640 * MB
    assert value(samples, "mllmd_cpu_utilization_ratio", core="0") == pytest.approx(0.97)
    assert value(samples, "mllmd_cpu_frequency_hertz", core="5") == 247 * MHZ
    assert value(samples, "mllmd_cpu_online", core="5") == 1.0
    assert value(samples, "mllmd_gpu_utilization_ratio") == pytest.approx(0.84)
    assert value(samples, "mllmd_gpu_frequency_hertz", gpc="0") == 713 * MHZ
    assert value(samples, "mllmd_emc_utilization_ratio") == pytest.approx(0.18)
    assert value(samples, "mllmd_emc_frequency_hertz") == 3199 * MHZ
    assert value(samples, "mllmd_temperature_celsius", sensor="gpu") == pytest.approx(63.5)
    assert ("mllmd_temperature_celsius", (("sensor", "cpu-thermal"),)) not in samples
    assert value(samples, "mllmd_power_watts", rail="VDD_IN") == pytest.approx(17.946)
    assert value(samples, "mllmd_power_average_watts", rail="VDD_IN") == pytest.approx(15.710)


def test_thor_line_has_no_gpu_utilization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TEGRASTATS_LINE", "THOR_JP72")
    metrics = Metrics()
    collector = TelemetryCollector({"interval": 0.05, "tegrastats_path": str(FAKE), "nvml": False},
                                   on_snapshot=metrics.set_telemetry, proc_root=tmp_path, sys_root=tmp_path)
    collector.start()
    try:
        wait_for(lambda: "tegrastats" in collector.latest().sources)
        samples = telemetry_samples(metrics)
    finally:
        collector.stop()
    names = names_of(samples)
    assert "mllmd_gpu_utilization_ratio" not in names and "mllmd_emc_utilization_ratio" not in names
    assert value(samples, "mllmd_power_watts", rail="VDD_GPU") == pytest.approx(37.528)
    assert value(samples, "mllmd_memory_total_bytes") == 125749 * MB


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): read its state
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_child_is_restarted_when_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "starts.log"
    monkeypatch.setenv("FAKE_TEGRASTATS_LOG", str(log))
    source = TegrastatsSource(str(FAKE), 0.05, backoff_initial=0.05, backoff_max=0.2)
    source.start()
    try:
        first = wait_for(lambda: source.pid)
        wait_for(lambda: source.latest() is not None)
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: source.pid if source.pid not in (None, first) else None)
        assert source.starts >= 2
        wait_for(lambda: len(log.read_text().splitlines()) >= 2)
        assert source.latest(max_age=5.0) is not None
    finally:
        source.stop()
    assert not _alive(second)
    assert source.pid is None


def test_child_that_keeps_exiting_is_restarted_with_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TEGRASTATS_EXIT_AFTER", "1")
    log = tmp_path / "starts.log"
    monkeypatch.setenv("FAKE_TEGRASTATS_LOG", str(log))
    source = TegrastatsSource(str(FAKE), 0.05, backoff_initial=0.05, backoff_max=0.1)
    source.start()
    try:
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 3)
        assert source.latest() is not None
    finally:
        source.stop()


def test_hung_child_is_killed_and_restarted(tmp_path: Path) -> None:
    # --interval 100000: one line, then silence.
    source = TegrastatsSource(str(FAKE), 100.0, backoff_initial=0.05, backoff_max=0.1, hang_after=0.3)
    source.start()
    try:
        first = wait_for(lambda: source.pid)
        wait_for(lambda: source.latest() is not None)
        assert not source.check_hung()
        time.sleep(0.4)
        assert source.check_hung()
        wait_for(lambda: source.pid not in (None, first))
    finally:
        source.stop()


def test_stale_sample_is_ignored() -> None:
    now = [100.0]
    source = TegrastatsSource(str(FAKE), 1.0, clock=lambda: now[0])
    source._sample, source._sample_at = parse_line(FAKE_LINES["AGX_ORIN_JP6"]), 100.0
    assert source.latest(max_age=5.0) is not None
    now[0] = 106.0
    assert source.latest(max_age=5.0) is None
    assert source.latest() is not None


def test_missing_binary_is_not_fatal(tmp_path: Path) -> None:
    source = TegrastatsSource(str(tmp_path / "gone"), 0.05, backoff_initial=0.05, backoff_max=0.1)
    source.start()
    try:
        time.sleep(0.3)
        assert source.latest() is None and source.pid is None
    finally:
        source.stop()


def test_dead_tegrastats_falls_back_to_procfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the child stops producing, its values expire and procfs fills in; GPU gauges vanish."""
    monkeypatch.setenv("FAKE_TEGRASTATS_LINE", "AGX_ORIN_JP6")
    proc, sys_ = fake_tree(tmp_path)
    metrics = Metrics()
    collector = TelemetryCollector({"interval": 0.05, "tegrastats_path": str(FAKE), "nvml": False},
                                   on_snapshot=metrics.set_telemetry, proc_root=proc, sys_root=sys_,
                                   tegrastats_backoff=(60.0, 60.0))
    collector.stale_after = 0.5
    collector.start()
    try:
        wait_for(lambda: "tegrastats" in collector.latest().sources)
        assert value(telemetry_samples(metrics), "mllmd_memory_used_bytes") == 18207 * MB
        assert collector.tegrastats is not None
        os.kill(wait_for(lambda: collector.tegrastats.pid), signal.SIGKILL)  # and no restart for 60 s
        wait_for(lambda: "tegrastats" not in collector.latest().sources)
        samples = telemetry_samples(metrics)
    finally:
        collector.stop()
    assert value(samples, "mllmd_memory_used_bytes") == 5000000 * 1024
    assert "mllmd_gpu_utilization_ratio" not in names_of(samples)
    assert "mllmd_power_watts" not in names_of(samples)
