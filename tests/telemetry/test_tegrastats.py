"""Tests for the tegrastats parser (`mllmd.telemetry.tegrastats`).

Every line in REAL_CASES is copied verbatim from a public source named in the comment above it
(a GitHub issue/PR thread, or a repository and path). Device and JetPack version are given as the
source states them; where the source does not state a version, the comment says so and gives the
evidence for the era. Lines in SYNTHETIC_CASES and the garbage/fuzz tests are made up here and are
labelled synthetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mllmd.telemetry.tegrastats import PowerRail, parse_line

REPO_ROOT = Path(__file__).resolve().parents[2]
MB = 1048576
MHZ = 1_000_000
KEYS = {
    "ram_used_bytes",
    "ram_total_bytes",
    "swap_used_bytes",
    "swap_total_bytes",
    "cpus",
    "gpu_utilization",
    "gpu_frequency_hz",
    "emc_utilization",
    "emc_frequency_hz",
    "temperatures_c",
    "power_mw",
}
OFF = {"online": False, "utilization": None, "frequency_hz": None}


def on(percent: int, mhz: int) -> dict[str, Any]:
    """An online core at `percent`% and `mhz` MHz."""
    return {"online": True, "utilization": percent / 100, "frequency_hz": mhz * MHZ}


def cores(mhz: int, *percents: int) -> list[dict[str, Any]]:
    """Online cores sharing one frequency."""
    return [on(p, mhz) for p in percents]


def rails(**values: tuple[int, int | None]) -> dict[str, dict[str, int | None]]:
    """`VDD_IN=(cur, avg)` -> the contract's rail objects."""
    return {name: {"current": cur, "average": avg} for name, (cur, avg) in values.items()}


def sample(
    ram: tuple[int, int],
    swap: tuple[int, int] | None,
    cpus: list[dict[str, Any]],
    gpu: int | None,
    gpcs_mhz: list[int | None],
    emc: int | None,
    emc_mhz: int | None,
    temps: dict[str, float],
    power: dict[str, dict[str, int | None]],
) -> dict[str, Any]:
    """The full expected JSON object, from values as tegrastats prints them (MB, %, MHz)."""
    return {
        "ram_used_bytes": ram[0] * MB,
        "ram_total_bytes": ram[1] * MB,
        "swap_used_bytes": None if swap is None else swap[0] * MB,
        "swap_total_bytes": None if swap is None else swap[1] * MB,
        "cpus": cpus,
        "gpu_utilization": None if gpu is None else gpu / 100,
        "gpu_frequency_hz": [None if f is None else f * MHZ for f in gpcs_mhz],
        "emc_utilization": None if emc is None else emc / 100,
        "emc_frequency_hz": None if emc_mhz is None else emc_mhz * MHZ,
        "temperatures_c": temps,
        "power_mw": power,
    }


# --------------------------------------------------------------------------------------------
# Real lines
# --------------------------------------------------------------------------------------------

# Jetson TX2, JetPack 4.2 era. Source: https://github.com/FindHao/tx-utils/issues/3 (2019-09-05,
# "the latest tegrastats"; version not stated, the date and the VDD_SYS_* rails place it on L4T
# R32.2 / JetPack 4.2). Non-root run: EMC_FREQ and GR3D_FREQ carry no frequency; no SWAP field.
TX2_JP42 = (
    "RAM 2020/7852MB (lfb 1164x4MB) CPU [9%@345,21%@345,25%@345,3%@345,1%@345,1%@345] "
    "EMC_FREQ 0% GR3D_FREQ 0% PLL@42.5C MCPU@42.5C PMIC@100C Tboard@40C GPU@41C BCPU@42.5C "
    "thermal@41.9C Tdiode@41.25C VDD_SYS_GPU 153/158 VDD_SYS_SOC 536/547 VDD_4V0_WIFI 633/527 "
    "VDD_IN 3140/3208 VDD_SYS_CPU 536/590 VDD_SYS_DDR 557/601"
)

# Jetson TX2 with both Denver cores off (JetPack 4.x-style output; version not stated).
# Source: DataDog/datadog-agent, pkg/collector/corechecks/nvidia/jetson/jetson_test.go (tx2Sample).
TX2_DENVER_OFF = (
    "RAM 2344/7852MB (lfb 1154x4MB) SWAP 0/3926MB (cached 0MB) "
    "CPU [1%@345,off,off,1%@345,0%@345,2%@345] EMC_FREQ 4%@1600 GR3D_FREQ 0%@624 APE 150 "
    "PLL@37.5C MCPU@37.5C PMIC@100C Tboard@32C GPU@35C BCPU@37.5C thermal@36.5C Tdiode@34.25C "
    "VDD_SYS_GPU 152/152 VDD_SYS_SOC 687/687 VDD_4V0_WIFI 0/0 VDD_IN 3056/3056 "
    "VDD_SYS_CPU 152/152 VDD_SYS_DDR 883/883"
)

# Jetson Nano, JetPack 4.6.1. Source: waggle-sensor/jetson-exporter, tegrastats_test.go
# (TestParseTegraStatsXavierNanoJetPack461). IRAM with `(lfb 252kB)`, GR3D_FREQ without brackets.
NANO_JP461 = (
    "RAM 1923/3964MB (lfb 2x2MB) SWAP 191/1982MB (cached 6MB) IRAM 0/252kB(lfb 252kB) "
    "CPU [5%@1224,4%@1224,3%@1224,6%@1224] EMC_FREQ 0%@1600 GR3D_FREQ 0%@76 APE 25 PLL@37C "
    "CPU@40C PMIC@50C GPU@40C AO@45C thermal@40C POM_5V_IN 1750/1628 POM_5V_GPU 0/0 "
    "POM_5V_CPU 366/406"
)

# Jetson Nano under load, JetPack 4.x (2021-09; version not stated). Source:
# https://github.com/dusty-nv/jetson-inference/issues/1206 (first two lines of the comment).
NANO_LOAD_1 = (
    "RAM 1501/3956MB (lfb 332x4MB) IRAM 0/252kB(lfb 252kB) CPU [16%@1479,13%@1479,10%@1479,4%@1479] "
    "EMC_FREQ 4%@1600 GR3D_FREQ 28%@76 NVDEC 716 VIC_FREQ 0%@140 APE 25 PLL@39C CPU@44C PMIC@100C "
    "GPU@41.5C AO@47.5C thermal@42.5C POM_5V_IN 4122/3107 POM_5V_GPU 109/85 POM_5V_CPU 1167/748"
)
NANO_LOAD_2 = (
    "RAM 1504/3956MB (lfb 331x4MB) IRAM 0/252kB(lfb 252kB) CPU [44%@1479,22%@1479,26%@1479,14%@1479] "
    "EMC_FREQ 7%@1600 GR3D_FREQ 86%@921 NVDEC 716 VIC_FREQ 0%@140 APE 25 PLL@39C CPU@44C PMIC@100C "
    "GPU@42.5C AO@47.5C thermal@42.5C POM_5V_IN 4531/3285 POM_5V_GPU 1113/213 POM_5V_CPU 539/722"
)

# Jetson AGX Xavier, JetPack 4.2 era (2019-06). Source: https://github.com/martinkersner/gtop/pull/7
# (tegrastats log in the 2019-06-17 comment). Rails named like sensors (`GPU 463/463` next to
# `GPU@30.5C`, `CPU 618/618`), no mW, EMC/GR3D without frequency.
AGX_XAVIER_JP42 = (
    "RAM 14700/15692MB (lfb 3x2MB) SWAP 898/8192MB (cached 23MB) "
    "CPU [0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190,0%@1190] EMC_FREQ 0% "
    "GR3D_FREQ 0% AO@30C GPU@30.5C Tboard@31C Tdiode@32C AUX@30.5C CPU@31.5C thermal@30.8C "
    "PMIC@100C GPU 463/463 CPU 618/618 SOC 2936/2936 CV 0/0 VDDRQ 309/309 SYS5V 3306/3306"
)

# Jetson AGX Xavier with four cores off (JetPack 4.x-style output; version not stated).
# Source: DataDog/datadog-agent, pkg/collector/corechecks/nvidia/jetson/jetson_test.go (agXSample).
AGX_XAVIER_OFF = (
    "RAM 721/31927MB (lfb 7291x4MB) SWAP 0/15963MB (cached 0MB) "
    "CPU [2%@1190,0%@1190,0%@1190,0%@1190,off,off,off,off] EMC_FREQ 0%@665 GR3D_FREQ 0%@318 "
    "APE 150 MTS fg 0% bg 0% AO@37.5C GPU@37.5C Tdiode@40C PMIC@100C AUX@36C CPU@37.5C "
    "thermal@36.9C Tboard@37C GPU 0/0 CPU 311/311 SOC 932/932 CV 0/0 VDDRQ 621/621 SYS5V 1482/1482"
)

# Jetson Xavier NX, JetPack 4 (the source's test is named "...XavierNXJetPack411").
# Source: waggle-sensor/jetson-exporter, tegrastats_test.go (TestParseTegraStatsXavierNXJetPack411).
XAVIER_NX_JP4 = (
    "RAM 5246/7771MB (lfb 7x4MB) SWAP 983/20269MB (cached 280MB) "
    "CPU [47%@1420,23%@1420,32%@1420,22%@1420,31%@1420,96%@1420] EMC_FREQ 2%@1600 "
    "GR3D_FREQ 0%@1109 APE 150 MTS fg 1% bg 9% AO@29C GPU@31.5C PMIC@100C AUX@30C CPU@33.5C "
    "thermal@31.35C VDD_IN 6140/5510 VDD_CPU_GPU_CV 2706/2119 VDD_SOC 1074/1051"
)

# Jetson Xavier NX, JetPack 5.1.2. Source: waggle-sensor/jetson-exporter, tegrastats_test.go
# (TestParseTegraStatsXavierNXJetPack512). Timestamp prefix, `GR3D_FREQ 0%@[114]`, rails in mW.
XAVIER_NX_JP512 = (
    "07-09-2024 13:31:31 RAM 3168/6851MB (lfb 2x4MB) SWAP 161/3426MB (cached 0MB) "
    "CPU [23%@1397,17%@1192,16%@1190,13%@1190,23%@1190,10%@1190] EMC_FREQ 2%@204 "
    "GR3D_FREQ 0%@[114] VIC_FREQ 115 APE 150 AUX@45C CPU@46.5C thermal@45.6C AO@45C GPU@45.5C "
    "PMIC@50C VDD_IN 2763mW/2846mW VDD_CPU_GPU_CV 650mW/670mW VDD_SOC 650mW/711mW"
)

# Jetson AGX Orin 64GB, JetPack 5.1 (L4T R35; the same post installs the jp/v51 PyTorch wheel),
# `sudo tegrastats` on 2023-04-24. Source: catid/blog2022, content/posts/orin_opt.md.
# JetPack 5.0/5.1 prints one field per GPC (GR3D_FREQ + GR3D2_FREQ), -256 offline sensors,
# and two rails both named NC.
AGX_ORIN_JP51 = (
    "04-24-2023 00:01:24 RAM 1282/62795MB (lfb 15152x4MB) SWAP 0/31398MB (cached 0MB) "
    "CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] "
    "EMC_FREQ 0%@2133 GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 VIC_FREQ 729 APE 174 CV0@-256C CPU@42.593C "
    "Tboard@32C SOC2@39.343C Tdiode@33.25C SOC0@39.375C CV1@-256C GPU@-256C tj@42.593C "
    "SOC1@40.468C CV2@-256C VDD_GPU_SOC 2399mW/2399mW VDD_CPU_CV 400mW/400mW "
    "VIN_SYS_5V0 4032mW/4032mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
)

# Jetson AGX Orin 64GB, JetPack 5.x naming (version not stated; upper-case R35 sensor names and
# the VDDQ_VDD2_1V8AO/NC rails). Source: https://github.com/GDWR/jetson_exporter/issues/14
# (2025-04-11). Per-GPC list `GR3D_FREQ 0%@[0,0]`.
AGX_ORIN_JP5 = (
    "04-11-2025 10:36:27 RAM 4321/62801MB (lfb 1759x4MB) SWAP 19/31400MB (cached 0MB) "
    "CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] "
    "EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174 CV0@-256C CPU@44.562C Tboard@32C "
    "SOC2@40.093C Tdiode@33C SOC0@41.093C CV1@-256C GPU@-256C tj@44.343C SOC1@41.25C CV2@-256C "
    "VDD_GPU_SOC 2340mW/2340mW VDD_CPU_CV 390mW/390mW VIN_SYS_5V0 4025mW/4025mW NC 0mW/0mW "
    "VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
)

# Jetson Orin NX 16GB class (8 cores, 15388MB) with four cores off, JetPack 5-style output
# (upper-case sensor names; version not stated). Source: DataDog/datadog-agent,
# pkg/collector/corechecks/nvidia/jetson/jetson_test.go (voltageUnitSample).
ORIN_NX_JP5_OFF = (
    "RAM 6334/15388MB (lfb 1770x4MB) SWAP 491/7694MB (cached 0MB) "
    "CPU [6%@729,9%@729,5%@729,16%@729,off,off,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@611 "
    "VIC_FREQ 729 APE 174 CV0@45.812C CPU@47.937C SOC2@46.093C SOC0@46.968C CV1@46.406C "
    "GPU@45.875C tj@48.875C SOC1@48.875C CV2@45.75C VDD_IN 5299mW/5299mW "
    "VDD_CPU_GPU_CV 773mW/773mW VDD_SOC 1424mW/1424mW"
)

# Jetson AGX Orin 64GB, JetPack 6.2.1 (L4T R36.4.4, nvidia-l4t-core 36.4.4-20250616085344).
# Source: lesomnus/tegra-exporter, stats/parse_test.go (case "5.15.148"). Engines as `x%@f`/`off`.
AGX_ORIN_JP6 = (
    "05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) "
    "CPU [14%@2188,5%@2112,8%@2035,14%@2201,46%@1267,47%@1267,2%@1267,10%@1267,4%@1036,5%@1036,"
    "6%@1036,10%@1036] EMC_FREQ 3%@2133 GR3D_FREQ 0%@[0,0] NVENC 79%@166 NVDEC off NVJPG off "
    "NVJPG1 off VIC 36%@115 OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 cpu@52.562C "
    "soc2@48.437C soc0@49.093C tj@52.562C soc1@49.656C VDD_GPU_SOC 2412mW/2412mW "
    "VDD_CPU_CV 1607mW/1607mW VIN_SYS_5V0 4707mW/4707mW"
)

# Jetson AGX Orin (12 cores, 30697MB), L4T R36 / JetPack 6 (the source names it r36Sample).
# Source: DataDog/datadog-agent, pkg/collector/corechecks/nvidia/jetson/jetson_test.go.
# Irregular spacing between fields is part of the real output.
AGX_ORIN_R36_SPACED = (
    "RAM 29114/30697MB (lfb 3x4MB)    SWAP 4915/15348MB (cached 1MB) "
    "CPU [3%@729,4%@729,0%@729,1%@729,0%@2201,100%@2201,1%@2201,0%@2201,100%@2201,0%@2201,"
    "0%@2201,0%@2201] EMC_FREQ 1%@2133 GR3D_FREQ 0%@[305,305] NVENC      off  NVDEC    off "
    "NVJPG off NVJPG1    off         VIC        off          OFA           off          "
    "NVDLA0    off       NVDLA1     off          PVA0_FREQ off         APE           174        "
    "cpu@53.062C soc2@48.25C soc0@48.843C  gpu@47.812C tj@53.062C soc1@48.968C    "
    "VDD_GPU_SOC 3205mW/3205mW VDD_CPU_CV 4405mW/4405mW VIN_SYS_5V0 4767mW/4767mW"
)

# Jetson AGX Orin 64GB without EMC and with `GR3D_FREQ 0%` only (non-root run; lower-case
# JetPack 6 sensor names, version not stated). Source: DataDog/datadog-agent,
# pkg/collector/corechecks/nvidia/jetson/jetson_test.go (orinSample).
AGX_ORIN_NO_EMC = (
    "RAM 2448/62840MB (lfb 2x4MB) SWAP 0/31420MB (cached 0MB) "
    "CPU [0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,"
    "0%@2201,0%@2201] GR3D_FREQ 0% cpu@42C soc2@37.843C soc0@39.187C gpu@37.75C tj@42C "
    "soc1@37.937C VDD_GPU_SOC 4940mW/4940mW VDD_CPU_CV 988mW/988mW VIN_SYS_5V0 4442mW/4442mW"
)

# Jetson Orin (6 cores, 7620MB, one NVDLA: Orin NX 8GB class), JetPack 6-style output (version not
# stated; lower-case R36 sensor names, EMC at 3199 MHz). Source:
# https://github.com/rbonghi/jetson_stats/issues/624 (2025-05-16). Busy GPU, `84%@[713]`.
ORIN_NX8_JP6 = (
    "05-15-2025 18:30:28 RAM 6982/7620MB (lfb 5x1MB) SWAP 2640/16384MB (cached 202MB) "
    "CPU [97%@1984,95%@1984,95%@1984,91%@1984,88%@1984,93%@247] EMC_FREQ 18%@3199 "
    "GR3D_FREQ 84%@[713] NVENC 1%@115 NVDEC 40%@115 NVJPG off NVJPG1 off VIC 31%@115 OFA off "
    "NVDLA0 off PVA0_FREQ off APE 174 cv0@63.031C cpu@65.562C soc2@64.156C soc0@63.031C "
    "cv1@62.937C gpu@63.5C tj@65.562C soc1@64.718C cv2@60.875C VDD_IN 17946mW/15710mW "
    "VDD_CPU_GPU_CV 8896mW/7585mW VDD_SOC 3923mW/3515mW"
)

# Jetson AGX Thor, JetPack 7.1 (L4T R38.4.0, nvidia-l4t-core 38.4.0-20251230160601).
# Source: lesomnus/tegra-exporter, stats/parse_test.go (case "6.8.12"). Three GPCs with no
# utilization (`GR3D_FREQ @[0,0,0]`), engines as `NAME_FREQ @f`.
THOR_JP71 = (
    "05-17-2026 10:00:32 RAM 4208/125773MB (lfb 31x4MB) SWAP 0/2048MB (cached 0MB) "
    "CPU [1%@972,0%@972,0%@972,0%@972,1%@972,0%@972,1%@972,1%@972,0%@972,0%@972,3%@972,0%@972,"
    "0%@972,1%@972] EMC_FREQ 0%@665 GR3D_FREQ @[0,0,0] NVENC0_FREQ @0 NVENC1_FREQ @0 "
    "NVDEC0_FREQ @0 NVDEC1_FREQ @0 NVJPG0_FREQ @0 VIC off OFA_FREQ @0 PVA0_FREQ off APE 300 "
    "cpu@34.468C tj@34.5C soc012@33.781C soc345@34.5C VDD_GPU 0mW/0mW "
    "VDD_CPU_SOC_MSS 4165mW/4165mW VIN_SYS_5V0 4126mW/4126mW"
)

# Jetson AGX Thor, JetPack 7.2 (kernel 6.8.12-l4t-r39.2.0), 2026-07-02, described by the source as
# verbatim. Source: wendylabsinc/wendy-agent, go/internal/agent/hoststats/gpu_test.go
# (TestParseTegrastatsJetPack7Thor). No GR3D_FREQ or EMC_FREQ at all; rails as cur/avg/peak.
THOR_JP72 = (
    "07-02-2026 13:45:44 RAM 36529/125749MB (lfb 12x4MB) SWAP 11/4096MB (cached 9MB) "
    "CPU [2%@972,1%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,0%@972,"
    "0%@972,2%@972] cpu@60.406C tj@63.281C soc012@58.468C gpu@62.906C soc345@63.281C "
    "VDD_GPU 37528mW/37528mW/37528mW VDD_CPU_SOC_MSS 18961mW/18961mW/18961mW "
    "VIN_SYS_5V0 18331mW/18331mW/18331mW VIN 87426mW/43713mW/87426mW"
)

# Jetson TX1, L4T 28.1 (JetPack 3.1): older than the JetPack 4 floor, kept because it is the form
# NVIDIA documents as `CPU [X%,Y%, , ]@Z` (one frequency for all cores) and it spells EMC/GR3D
# without `_FREQ`. Source: hordiales/jetson-tx1-dev, SCRIPTS.md (`sudo ~/tegrastats` example).
TX1_L4T281 = (
    "RAM 3468/3983MB (lfb 48x4MB) SWAP 873/8192MB (cached 295MB) cpu [17%,13%,29%,5%]@408 "
    "EMC 1%@408 APE 25 GR3D 3%@76"
)

REAL_CASES = [
    pytest.param(
        TX2_JP42,
        sample(
            (2020, 7852),
            None,
            cores(345, 9, 21, 25, 3, 1, 1),
            0,
            [],
            0,
            None,
            {
                "PLL": 42.5,
                "MCPU": 42.5,
                "PMIC": 100.0,
                "Tboard": 40.0,
                "GPU": 41.0,
                "BCPU": 42.5,
                "thermal": 41.9,
                "Tdiode": 41.25,
            },
            rails(
                VDD_SYS_GPU=(153, 158),
                VDD_SYS_SOC=(536, 547),
                VDD_4V0_WIFI=(633, 527),
                VDD_IN=(3140, 3208),
                VDD_SYS_CPU=(536, 590),
                VDD_SYS_DDR=(557, 601),
            ),
        ),
        id="tx2-jp4.2-no-freq-no-swap",
    ),
    pytest.param(
        TX2_DENVER_OFF,
        sample(
            (2344, 7852),
            (0, 3926),
            [on(1, 345), OFF, OFF, on(1, 345), on(0, 345), on(2, 345)],
            0,
            [624],
            4,
            1600,
            {
                "PLL": 37.5,
                "MCPU": 37.5,
                "PMIC": 100.0,
                "Tboard": 32.0,
                "GPU": 35.0,
                "BCPU": 37.5,
                "thermal": 36.5,
                "Tdiode": 34.25,
            },
            rails(
                VDD_SYS_GPU=(152, 152),
                VDD_SYS_SOC=(687, 687),
                VDD_4V0_WIFI=(0, 0),
                VDD_IN=(3056, 3056),
                VDD_SYS_CPU=(152, 152),
                VDD_SYS_DDR=(883, 883),
            ),
        ),
        id="tx2-jp4-denver-off",
    ),
    pytest.param(
        NANO_JP461,
        sample(
            (1923, 3964),
            (191, 1982),
            cores(1224, 5, 4, 3, 6),
            0,
            [76],
            0,
            1600,
            {"PLL": 37.0, "CPU": 40.0, "PMIC": 50.0, "GPU": 40.0, "AO": 45.0, "thermal": 40.0},
            rails(POM_5V_IN=(1750, 1628), POM_5V_GPU=(0, 0), POM_5V_CPU=(366, 406)),
        ),
        id="nano-jp4.6.1-iram",
    ),
    pytest.param(
        NANO_LOAD_1,
        sample(
            (1501, 3956),
            None,
            cores(1479, 16, 13, 10, 4),
            28,
            [76],
            4,
            1600,
            {"PLL": 39.0, "CPU": 44.0, "PMIC": 100.0, "GPU": 41.5, "AO": 47.5, "thermal": 42.5},
            rails(POM_5V_IN=(4122, 3107), POM_5V_GPU=(109, 85), POM_5V_CPU=(1167, 748)),
        ),
        id="nano-jp4-load-1",
    ),
    pytest.param(
        NANO_LOAD_2,
        sample(
            (1504, 3956),
            None,
            cores(1479, 44, 22, 26, 14),
            86,
            [921],
            7,
            1600,
            {"PLL": 39.0, "CPU": 44.0, "PMIC": 100.0, "GPU": 42.5, "AO": 47.5, "thermal": 42.5},
            rails(POM_5V_IN=(4531, 3285), POM_5V_GPU=(1113, 213), POM_5V_CPU=(539, 722)),
        ),
        id="nano-jp4-load-2",
    ),
    pytest.param(
        AGX_XAVIER_JP42,
        sample(
            (14700, 15692),
            (898, 8192),
            cores(1190, 0, 0, 0, 0, 0, 0, 0, 0),
            0,
            [],
            0,
            None,
            {
                "AO": 30.0,
                "GPU": 30.5,
                "Tboard": 31.0,
                "Tdiode": 32.0,
                "AUX": 30.5,
                "CPU": 31.5,
                "thermal": 30.8,
                "PMIC": 100.0,
            },
            rails(
                GPU=(463, 463),
                CPU=(618, 618),
                SOC=(2936, 2936),
                CV=(0, 0),
                VDDRQ=(309, 309),
                SYS5V=(3306, 3306),
            ),
        ),
        id="agx-xavier-jp4.2-bare-rails",
    ),
    pytest.param(
        AGX_XAVIER_OFF,
        sample(
            (721, 31927),
            (0, 15963),
            [*cores(1190, 2, 0, 0, 0), OFF, OFF, OFF, OFF],
            0,
            [318],
            0,
            665,
            {
                "AO": 37.5,
                "GPU": 37.5,
                "Tdiode": 40.0,
                "PMIC": 100.0,
                "AUX": 36.0,
                "CPU": 37.5,
                "thermal": 36.9,
                "Tboard": 37.0,
            },
            rails(
                GPU=(0, 0),
                CPU=(311, 311),
                SOC=(932, 932),
                CV=(0, 0),
                VDDRQ=(621, 621),
                SYS5V=(1482, 1482),
            ),
        ),
        id="agx-xavier-jp4-four-off",
    ),
    pytest.param(
        XAVIER_NX_JP4,
        sample(
            (5246, 7771),
            (983, 20269),
            cores(1420, 47, 23, 32, 22, 31, 96),
            0,
            [1109],
            2,
            1600,
            {
                "AO": 29.0,
                "GPU": 31.5,
                "PMIC": 100.0,
                "AUX": 30.0,
                "CPU": 33.5,
                "thermal": 31.35,
            },
            rails(VDD_IN=(6140, 5510), VDD_CPU_GPU_CV=(2706, 2119), VDD_SOC=(1074, 1051)),
        ),
        id="xavier-nx-jp4",
    ),
    pytest.param(
        XAVIER_NX_JP512,
        sample(
            (3168, 6851),
            (161, 3426),
            [
                on(23, 1397),
                on(17, 1192),
                on(16, 1190),
                on(13, 1190),
                on(23, 1190),
                on(10, 1190),
            ],
            0,
            [114],
            2,
            204,
            {
                "AUX": 45.0,
                "CPU": 46.5,
                "thermal": 45.6,
                "AO": 45.0,
                "GPU": 45.5,
                "PMIC": 50.0,
            },
            rails(VDD_IN=(2763, 2846), VDD_CPU_GPU_CV=(650, 670), VDD_SOC=(650, 711)),
        ),
        id="xavier-nx-jp5.1.2",
    ),
    pytest.param(
        AGX_ORIN_JP51,
        sample(
            (1282, 62795),
            (0, 31398),
            cores(729, *[0] * 12),
            0,
            [0, 0],
            0,
            2133,
            {
                "CPU": 42.593,
                "Tboard": 32.0,
                "SOC2": 39.343,
                "Tdiode": 33.25,
                "SOC0": 39.375,
                "tj": 42.593,
                "SOC1": 40.468,
            },
            rails(
                VDD_GPU_SOC=(2399, 2399),
                VDD_CPU_CV=(400, 400),
                VIN_SYS_5V0=(4032, 4032),
                NC=(0, 0),
                VDDQ_VDD2_1V8AO=(301, 301),
            ),
        ),
        id="agx-orin-jp5.1-gr3d2",
    ),
    pytest.param(
        AGX_ORIN_JP5,
        sample(
            (4321, 62801),
            (19, 31400),
            cores(729, *[0] * 12),
            0,
            [0, 0],
            0,
            2133,
            {
                "CPU": 44.562,
                "Tboard": 32.0,
                "SOC2": 40.093,
                "Tdiode": 33.0,
                "SOC0": 41.093,
                "tj": 44.343,
                "SOC1": 41.25,
            },
            rails(
                VDD_GPU_SOC=(2340, 2340),
                VDD_CPU_CV=(390, 390),
                VIN_SYS_5V0=(4025, 4025),
                NC=(0, 0),
                VDDQ_VDD2_1V8AO=(301, 301),
            ),
        ),
        id="agx-orin-jp5-gpc-list",
    ),
    pytest.param(
        ORIN_NX_JP5_OFF,
        sample(
            (6334, 15388),
            (491, 7694),
            [*cores(729, 6, 9, 5, 16), OFF, OFF, OFF, OFF],
            0,
            [611],
            0,
            2133,
            {
                "CV0": 45.812,
                "CPU": 47.937,
                "SOC2": 46.093,
                "SOC0": 46.968,
                "CV1": 46.406,
                "GPU": 45.875,
                "tj": 48.875,
                "SOC1": 48.875,
                "CV2": 45.75,
            },
            rails(VDD_IN=(5299, 5299), VDD_CPU_GPU_CV=(773, 773), VDD_SOC=(1424, 1424)),
        ),
        id="orin-nx16-jp5-four-off",
    ),
    pytest.param(
        AGX_ORIN_JP6,
        sample(
            (18207, 62841),
            (86, 31420),
            [
                on(14, 2188),
                on(5, 2112),
                on(8, 2035),
                on(14, 2201),
                *cores(1267, 46, 47, 2, 10),
                *cores(1036, 4, 5, 6, 10),
            ],
            0,
            [0, 0],
            3,
            2133,
            {"cpu": 52.562, "soc2": 48.437, "soc0": 49.093, "tj": 52.562, "soc1": 49.656},
            rails(VDD_GPU_SOC=(2412, 2412), VDD_CPU_CV=(1607, 1607), VIN_SYS_5V0=(4707, 4707)),
        ),
        id="agx-orin-jp6.2.1",
    ),
    pytest.param(
        AGX_ORIN_R36_SPACED,
        sample(
            (29114, 30697),
            (4915, 15348),
            [*cores(729, 3, 4, 0, 1), *cores(2201, 0, 100, 1, 0, 100, 0, 0, 0)],
            0,
            [305, 305],
            1,
            2133,
            {
                "cpu": 53.062,
                "soc2": 48.25,
                "soc0": 48.843,
                "gpu": 47.812,
                "tj": 53.062,
                "soc1": 48.968,
            },
            rails(VDD_GPU_SOC=(3205, 3205), VDD_CPU_CV=(4405, 4405), VIN_SYS_5V0=(4767, 4767)),
        ),
        id="agx-orin-r36-irregular-spacing",
    ),
    pytest.param(
        AGX_ORIN_NO_EMC,
        sample(
            (2448, 62840),
            (0, 31420),
            cores(2201, *[0] * 12),
            0,
            [],
            None,
            None,
            {
                "cpu": 42.0,
                "soc2": 37.843,
                "soc0": 39.187,
                "gpu": 37.75,
                "tj": 42.0,
                "soc1": 37.937,
            },
            rails(VDD_GPU_SOC=(4940, 4940), VDD_CPU_CV=(988, 988), VIN_SYS_5V0=(4442, 4442)),
        ),
        id="agx-orin-jp6-no-emc",
    ),
    pytest.param(
        ORIN_NX8_JP6,
        sample(
            (6982, 7620),
            (2640, 16384),
            [*cores(1984, 97, 95, 95, 91, 88), on(93, 247)],
            84,
            [713],
            18,
            3199,
            {
                "cv0": 63.031,
                "cpu": 65.562,
                "soc2": 64.156,
                "soc0": 63.031,
                "cv1": 62.937,
                "gpu": 63.5,
                "tj": 65.562,
                "soc1": 64.718,
                "cv2": 60.875,
            },
            rails(VDD_IN=(17946, 15710), VDD_CPU_GPU_CV=(8896, 7585), VDD_SOC=(3923, 3515)),
        ),
        id="orin-nx8-jp6-busy",
    ),
    pytest.param(
        THOR_JP71,
        sample(
            (4208, 125773),
            (0, 2048),
            cores(972, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 3, 0, 0, 1),
            None,
            [0, 0, 0],
            0,
            665,
            {"cpu": 34.468, "tj": 34.5, "soc012": 33.781, "soc345": 34.5},
            rails(VDD_GPU=(0, 0), VDD_CPU_SOC_MSS=(4165, 4165), VIN_SYS_5V0=(4126, 4126)),
        ),
        id="thor-jp7.1-three-gpcs",
    ),
    pytest.param(
        THOR_JP72,
        sample(
            (36529, 125749),
            (11, 4096),
            cores(972, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2),
            None,
            [],
            None,
            None,
            {"cpu": 60.406, "tj": 63.281, "soc012": 58.468, "gpu": 62.906, "soc345": 63.281},
            rails(
                VDD_GPU=(37528, 37528),
                VDD_CPU_SOC_MSS=(18961, 18961),
                VIN_SYS_5V0=(18331, 18331),
                VIN=(87426, 43713),
            ),
        ),
        id="thor-jp7.2-cur-avg-peak",
    ),
    pytest.param(
        TX1_L4T281,
        sample(
            (3468, 3983),
            (873, 8192),
            cores(408, 17, 13, 29, 5),
            3,
            [76],
            1,
            408,
            {},
            {},
        ),
        id="tx1-l4t28.1-shared-cpu-freq",
    ),
]


@pytest.mark.parametrize(("line", "expected"), REAL_CASES)
def test_real_line(line: str, expected: dict[str, Any]) -> None:
    parsed = parse_line(line)
    assert parsed is not None
    out = parsed.to_json_dict()
    assert set(out) == KEYS
    assert out == expected
    json.dumps(out, allow_nan=False)  # JSON-clean


def test_real_lines_cover_six_families() -> None:
    """TX2/Nano JP4, Xavier JP4/JP5, Orin JP5, Orin JP6 and Thor JP7 are all represented."""
    ids = {p.id for p in REAL_CASES}
    for family in ("tx2-jp4", "nano-jp4", "xavier", "orin-jp5", "orin-jp6", "thor-jp7"):
        assert any(family in case_id for case_id in ids), family


def test_offline_cores_keep_their_position() -> None:
    cpus = parse_line(TX2_DENVER_OFF).cpus
    assert [c.online for c in cpus] == [True, False, False, True, True, True]
    cpus = parse_line(AGX_XAVIER_OFF).cpus
    assert len(cpus) == 8 and [c.online for c in cpus[4:]] == [False] * 4


def test_offline_temperature_sensors_are_omitted() -> None:
    temps = parse_line(AGX_ORIN_JP51).temperatures_c
    assert not {"CV0", "CV1", "CV2", "GPU"} & set(temps)
    assert all(value != -256 for value in temps.values())


def test_same_name_for_sensor_and_rail_stays_separate() -> None:
    """AGX Xavier JetPack 4.2 prints `GPU@30.5C` and the rail `GPU 463/463` on one line."""
    parsed = parse_line(AGX_XAVIER_JP42)
    assert parsed.temperatures_c["GPU"] == 30.5
    assert parsed.power_mw["GPU"] == PowerRail(463, 463)
    assert parsed.power_mw["CPU"] == PowerRail(618, 618)
    assert len(parsed.cpus) == 8


def test_thor_peak_is_kept_in_the_dataclass_but_not_in_json() -> None:
    parsed = parse_line(THOR_JP72)
    assert parsed.power_mw["VIN"] == PowerRail(current=87426, average=43713, peak=87426)
    assert parsed.to_json_dict()["power_mw"]["VIN"] == {"current": 87426, "average": 43713}


# --------------------------------------------------------------------------------------------
# Synthetic lines (made up here, following formats named in the project's issue)
# --------------------------------------------------------------------------------------------

SYNTHETIC_CASES = [
    pytest.param(
        # Synthetic: the examples in one line (timestamp, `off` cores, engines in every
        # spelling, cur/peak temperature, rails with and without mW, cur/avg/peak rail).
        "11-29-2026 07:22:18 RAM 3000/7620MB (lfb 2x4MB) SWAP 0/3936MB (cached 0MB) "
        "CPU [12%@1510,off,3%@1510,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[305,305] APE 150 "
        "NVDEC off NVENC 1036 VIC_FREQ 0%@115 NVJPG0 off CPU@45.5C cpu@58.25C/61.75C CV0@-256C "
        "VDD_IN 5000mW/5000mW POM_5V_IN 2000/2000 VDD_CPU_GPU_CV 1234mW/1200mW/1500mW",
        sample(
            (3000, 7620),
            (0, 3936),
            [on(12, 1510), OFF, on(3, 1510), OFF],
            0,
            [305, 305],
            0,
            2133,
            {"CPU": 45.5, "cpu": 58.25},
            rails(VDD_IN=(5000, 5000), POM_5V_IN=(2000, 2000), VDD_CPU_GPU_CV=(1234, 1200)),
        ),
        id="synthetic-issue-examples",
    ),
    pytest.param(
        # Synthetic: tabs and double spaces, spaces inside brackets, unreadable CPU and GPC
        # entries, EMC with frequency only, a single-value rail, an unknown trailing token.
        "RAM  100/200MB\tCPU [ 5%@100 , off ,N/A ]  GR3D_FREQ 20%@[0, 300,off] "
        "EMC_FREQ @1600\tVIN 5517mW FUTURE_FIELD 42 weird@@ ]",
        sample(
            (100, 200),
            None,
            [on(5, 100), OFF, {"online": True, "utilization": None, "frequency_hz": None}],
            20,
            [0, 300, None],
            None,
            1600,
            {},
            {"VIN": {"current": 5517, "average": None}},
        ),
        id="synthetic-irregular",
    ),
    pytest.param(
        # Synthetic: JetPack 5.0 split GPC fields in reverse order, busy GPU; the GPC list
        # follows GPC numbering, not print order; utilization comes from GR3D_FREQ.
        "RAM 1/2MB GR3D2_FREQ 50%@612 GR3D_FREQ 99%@611",
        sample((1, 2), None, [], 99, [611, 612], None, None, {}, {}),
        id="synthetic-gr3d2-first",
    ),
    pytest.param(
        # Synthetic: out-of-range percentages are clamped to 0..1.
        "RAM 1/2MB CPU [150%@10] GR3D_FREQ 101% EMC_FREQ 200%",
        sample(
            (1, 2),
            None,
            [{"online": True, "utilization": 1.0, "frequency_hz": 10 * MHZ}],
            100,
            [],
            100,
            None,
            {},
            {},
        ),
        id="synthetic-clamp",
    ),
]


@pytest.mark.parametrize(("line", "expected"), SYNTHETIC_CASES)
def test_synthetic_line(line: str, expected: dict[str, Any]) -> None:
    parsed = parse_line(line)
    assert parsed is not None
    assert parsed.to_json_dict() == expected


# Synthetic garbage: none of these is tegrastats output, so each yields None.
GARBAGE = [
    "",
    "\n",
    "   ",
    "hello world",
    "RAM",
    "RAM abc/defMB",
    "RAM 12/34",  # no unit
    "CPU [1%@100,off] GR3D_FREQ 0%@[305] VDD_IN 1/1",  # everything but RAM
    "IRAM 0/252kB(lfb 252kB)",  # IRAM is not RAM
    "tegrastats: command not found",
    "Segmentation fault (core dumped)",
    "\x00\x01\x02\ufffd\ufffd",
    "RAM 1" + "9" * 5000 + "/2MB",  # a runaway number is skipped, not parsed
    "[" * 1000 + "]" * 1000,
]


@pytest.mark.parametrize("line", GARBAGE)
def test_garbage_yields_none(line: str) -> None:
    assert parse_line(line) is None


# --------------------------------------------------------------------------------------------
# Fuzz (synthetic input by construction)
# --------------------------------------------------------------------------------------------

TOKENS = [
    "RAM 1/2MB",
    "SWAP 0/3MB",
    "(cached 0MB)",
    "(lfb 2x4MB)",
    "IRAM 0/252kB(lfb 252kB)",
    "CPU [",
    "]",
    "@",
    "%",
    ",",
    "off",
    "GR3D_FREQ",
    "GR3D2_FREQ",
    "EMC_FREQ",
    "@[",
    "[305,305]",
    "0%@1190",
    "99%",
    "cpu@45.5C",
    "CV0@-256C",
    "x@1C/2C",
    "VDD_IN",
    "5000mW/5000mW",
    "1/2/3",
    "NC",
    "0mW",
    "APE 150",
    "-",
    "/",
    "11-29-2026 07:22:18",
]


def _check_invariants(line: str) -> None:
    parsed = parse_line(line)
    if parsed is None:
        return
    out = parsed.to_json_dict()
    assert set(out) == KEYS
    json.dumps(out, allow_nan=False)
    for ratio in (out["gpu_utilization"], out["emc_utilization"]):
        assert ratio is None or 0.0 <= ratio <= 1.0
    for cpu in out["cpus"]:
        assert set(cpu) == {"online", "utilization", "frequency_hz"}
        assert cpu["utilization"] is None or 0.0 <= cpu["utilization"] <= 1.0
        if not cpu["online"]:
            assert cpu["utilization"] is None and cpu["frequency_hz"] is None
    assert all(f is None or (isinstance(f, int) and f >= 0) for f in out["gpu_frequency_hz"])
    assert all(value != -256 for value in out["temperatures_c"].values())
    for rail in out["power_mw"].values():
        assert set(rail) == {"current", "average"} and isinstance(rail["current"], int)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_random_text_never_raises(line: str) -> None:
    _check_invariants(line)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(st.sampled_from(TOKENS), st.text(alphabet="0123456789%@[],/.-CmWMBk offRA", max_size=8)),
        max_size=40,
    ),
    st.sampled_from(["", " ", "\t", "  "]),
)
def test_fuzz_token_soup_keeps_the_contract(tokens: list[str], sep: str) -> None:
    _check_invariants("RAM 1/2MB " + (sep or " ").join(tokens))
    _check_invariants(sep.join(tokens))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([p.values[0] for p in REAL_CASES]), st.data())
def test_fuzz_mutated_real_lines_never_raise(line: str, data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(line)))
    end = data.draw(st.integers(start, len(line)))
    junk = data.draw(st.text(max_size=10))
    _check_invariants(line[:start] + junk + line[end:])


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _run_cli(stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "mllmd.telemetry.tegrastats"],
        input=stdin,
        capture_output=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )


def test_cli_prints_one_json_object_per_tegrastats_line() -> None:
    real = [p.values[0] for p in REAL_CASES]
    garbage = ["", "hello", "Segmentation fault", "CPU [1%@100]"]
    interleaved: list[str] = []
    for i, line in enumerate(real):
        interleaved.append(line)
        interleaved.append(garbage[i % len(garbage)])
    stdin = ("\n".join(interleaved) + "\n").encode() + b"\xff\xfe not utf-8\n"
    proc = _run_cli(stdin)
    assert proc.returncode == 0, proc.stderr.decode()
    out_lines = proc.stdout.decode().splitlines()
    assert len(out_lines) == len(real)
    for line, text in zip(real, out_lines, strict=True):
        obj = json.loads(text)
        assert set(obj) == KEYS
        for cpu in obj["cpus"]:
            assert set(cpu) == {"online", "utilization", "frequency_hz"}
        for rail in obj["power_mw"].values():
            assert set(rail) == {"current", "average"}
        assert obj == parse_line(line).to_json_dict()


def test_cli_empty_input_and_help() -> None:
    proc = _run_cli(b"")
    assert proc.returncode == 0 and proc.stdout == b""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    help_proc = subprocess.run(
        [sys.executable, "-m", "mllmd.telemetry.tegrastats", "--help"],
        capture_output=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert help_proc.returncode == 0 and b"stdin" in help_proc.stdout


def test_module_does_not_import_torch() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)
    code = "import sys, mllmd.telemetry.tegrastats; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, cwd=REPO_ROOT, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
