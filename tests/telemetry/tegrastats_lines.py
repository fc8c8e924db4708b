"""Real tegrastats output, one named constant for each line, copied from the public sources cited.

Every line here is copied verbatim from a public source named in the comment above it (a GitHub
issue/PR thread, or a repository and path). Device and JetPack version are given as the source
states them; where the source does not state a version, the comment says so and gives the evidence
for the era. Pure data with no imports: `tegrastats_cases.py` pairs each line with its expected
parse, and `test_sources.py` loads this file by path to check that `fake_tegrastats` prints the same
lines.
"""

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
