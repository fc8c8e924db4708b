"""scripts/kernel_marginals.py: per-kernel marginal time of a profiled step whose kernels overlap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.kernel_marginals import kernel_events, marginals, report


def _k(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "ph": "X"}


def _trace() -> dict:
    # gemv 0-10; rope launched early (PDL) at 8, waits, ends 12; attention 20-25 after 8 us idle;
    # a CPU op and a memcpy are not kernels
    return {
        "traceEvents": [
            _k("gemv", 0.0, 10.0),
            _k("rope", 8.0, 4.0),
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 13.0, "dur": 2.0},
            _k("attention", 20.0, 5.0),
            _k("gemv", 24.0, 6.0),  # overlaps attention's last us: charged 5
        ]
    }


def test_overlapping_kernels_are_charged_the_span_they_add() -> None:
    m = marginals(kernel_events(_trace()))
    assert m.span_us == pytest.approx(30.0)
    assert m.idle_us == pytest.approx(8.0)  # 12 -> 20
    assert m.kernels["gemv"].calls == 2
    assert m.kernels["gemv"].marginal_us == pytest.approx(10.0 + 5.0)
    assert m.kernels["gemv"].duration_us == pytest.approx(16.0)
    assert m.kernels["rope"].marginal_us == pytest.approx(2.0)  # 10 -> 12, not its 4 us
    assert m.kernels["attention"].marginal_us == pytest.approx(5.0)
    assert sum(c.marginal_us for c in m.kernels.values()) + m.idle_us == pytest.approx(m.span_us)


def test_kernels_are_taken_in_the_order_they_end() -> None:
    # a long kernel (another stream) that started first but ends last is charged only what sticks out
    # past the others; the gaps before a and b count as idle although it covers them
    m = marginals([_k("long", 0.0, 20.0), _k("a", 1.0, 4.0), _k("b", 6.0, 4.0)])
    assert m.kernels["a"].marginal_us == pytest.approx(4.0)
    assert m.kernels["b"].marginal_us == pytest.approx(4.0)
    assert m.kernels["long"].marginal_us == pytest.approx(10.0)
    assert m.idle_us == pytest.approx(2.0)  # 0 -> 1 and 5 -> 6
    assert sum(c.marginal_us for c in m.kernels.values()) + m.idle_us == pytest.approx(m.span_us)
    assert marginals([]).span_us == 0.0


def test_report_and_command_line(tmp_path: Path) -> None:
    text = report(marginals(kernel_events(_trace())), steps=2)
    lines = text.splitlines()
    assert lines[0] == "span 15.0 us/step = kernels 11.0 + idle 4.0"
    assert lines[2].split() == ["7.5", "1.0", "7.50", "8.00", "gemv"]  # the largest first
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()["traceEvents"]))  # a bare event list is a trace too
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "kernel_marginals.py"), str(path), "--steps", "2"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert proc.stdout.strip() == text
