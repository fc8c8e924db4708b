"""MLLMD_STEP_TRACE: one JSON line per scheduler iteration that did work, with the step's token counts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mllmd.messages import GenerateRequest
from mllmd.sampling_params import SamplingParams
from mllmd.workers.scheduler_worker import StepTrace
from scripts.serving_timeline import lags
from scripts.step_trace_summary import summarize


def _engine() -> SimpleNamespace:
    stats = SimpleNamespace(prefill_tokens_computed=0, decode_tokens_computed=0)
    return SimpleNamespace(scheduler=SimpleNamespace(stats=stats, running=[1, 2], waiting=[3]))


def test_off_unless_the_variable_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLLMD_STEP_TRACE", raising=False)
    assert StepTrace.from_env(_engine()) is None


def test_lines_carry_each_steps_tokens_and_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MLLMD_STEP_TRACE", str(path))
    engine = _engine()
    trace = StepTrace.from_env(engine)
    assert trace is not None
    stats = engine.scheduler.stats
    trace.received(GenerateRequest("a", [1], SamplingParams(), t_submit=9.5))
    trace.received(GenerateRequest("b", [1], SamplingParams()))  # no submit time: not listed
    stats.prefill_tokens_computed = 300  # a mixed step: one prompt of 300 and 2 decodes
    stats.decode_tokens_computed = 2
    trace.record(10.0, 10.001, 10.021, 10.0215, 2)
    trace.record(10.03, 10.03, 10.03, 10.03, 0)  # idle iteration: nothing computed, nothing sent
    stats.decode_tokens_computed = 4
    trace.record(10.04, 10.04, 10.045, 10.0451, 2)
    trace.file.flush()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["prefill"], r["decode"], r["outputs"]) for r in lines] == [(300, 2, 2), (0, 2, 2)]
    assert lines[0]["step_ms"] == pytest.approx(20.0) and lines[0]["msgs_ms"] == pytest.approx(1.0)
    assert lines[0]["running"] == 2 and lines[0]["waiting"] == 1
    assert lines[0]["submitted"] == [9.5] and lines[1]["submitted"] == []
    summary = summarize(lines)
    assert summary["with_prefill"]["n"] == 1 and summary["decode_only"]["tokens"] == 2


def test_timeline_splits_the_wait_between_client_main_and_scheduler() -> None:
    """Three requests sent at 0, 1, 2 s; main submits each 10 ms later; the scheduler's iteration that
    received the last one ended 0.5 s after its submit (a long step)."""
    requests = [{"start": 0.0}, {"start": 1.0}, {"start": 2.0}]
    steps = [
        {"t": 0.0, "msgs_ms": 20.0, "submitted": [0.01]},
        {"t": 1.0, "msgs_ms": 20.0, "submitted": [1.01]},
        {"t": 2.0, "msgs_ms": 510.0, "submitted": [2.01]},
        {"t": 3.0, "msgs_ms": 0.0, "submitted": []},
    ]
    out = lags(requests, steps)
    assert out["matched"] == 3
    assert out["client_to_main_ms"]["p50"] == pytest.approx(10.0) and out["client_to_main_ms"]["max"] == pytest.approx(10.0)
    assert out["main_to_scheduler_ms"]["p50"] == pytest.approx(10.0)
    assert out["main_to_scheduler_ms"]["max"] == pytest.approx(500.0)
