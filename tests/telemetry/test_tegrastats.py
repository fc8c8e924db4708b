"""Tests for the tegrastats line parser (`mllmd.telemetry.tegrastats.parse_line`).

Checks that every real line (`tegrastats_lines.py`, each copied from a cited public source, with its
expected parse in `tegrastats_cases.py`) parses to the exact JSON object of the contract, that
offline cores and sensors, same-named sensors and rails and cur/avg/peak rails are handled, that
synthetic lines (irregular spacing, split GPC fields, out-of-range values; made up here and labelled
so) parse as expected, that garbage yields None, and, by fuzzing random text, token soups and
mutated real lines, that the parser never raises and always keeps the contract.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tegrastats_cases import KEYS, MHZ, OFF, REAL_CASES, on, rails, sample
from tegrastats_lines import AGX_ORIN_JP51, AGX_XAVIER_JP42, AGX_XAVIER_OFF, THOR_JP72, TX2_DENVER_OFF

from mllmd.telemetry.tegrastats import PowerRail, parse_line

# --------------------------------------------------------------------------------------------
# Real lines (tegrastats_lines.py, expected parses in tegrastats_cases.py)
# --------------------------------------------------------------------------------------------


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
